"""Serve the viewer on a local port until Ctrl-C or SIGTERM, and open it in
a browser.

The socket is bound before the model is compiled, so a taken port is one
clear error at once; connections made before the app runs wait in its
backlog. A browser is opened only where one can show a window (a desktop
session, macOS, Windows): on a server ``webbrowser`` would start a text
browser in the terminal the viewer's log is written to.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from typing import Callable

from fastapi import FastAPI



def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: any free one): the
    server's own, so a bad host or a taken port reads the same in both."""
    from ...serve.server import bind_socket

    return bind_socket(host, port)


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    if ":" in host:
        host = f"[{host}]"
    elif host == "0.0.0.0":
        host = "127.0.0.1"
    return f"http://{host}:{port}/"


def can_show_browser() -> bool:
    """Whether a graphical browser can open here."""
    if sys.platform in ("darwin", "win32"):
        return True
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def open_browser(url: str, warn: Callable[[str], None]) -> None:
    """Open ``url`` in the user's browser, on a thread; never fails."""
    if not can_show_browser():
        warn("no display to open a browser on: open the URL yourself")
        return

    def go() -> None:
        import webbrowser

        try:
            if not webbrowser.open(url):
                warn("could not open a browser: open the URL yourself")
        except Exception as e:   # webbrowser raises whatever its launcher does
            warn(f"could not open a browser ({e}): open the URL yourself")

    threading.Thread(target=go, name="lmc-viz-browser", daemon=True).start()


def serve(app: FastAPI, sock: socket.socket, on_ready: Callable[[], None] | None = None) -> None:
    """Run ``app`` on ``sock`` until SIGINT or SIGTERM; returns normally
    then. ``on_ready()`` once it serves (and handles those signals)."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:  # type: ignore[no-untyped-def]
            await super().startup(sockets)
            if on_ready is not None and not self.should_exit:
                on_ready()

    server = Server(uvicorn.Config(app, log_level="warning", access_log=False))
    # uvicorn handles SIGINT/SIGTERM while it serves, then re-raises the
    # signal to the handler it found: make that a no-op, so a stopped viewer
    # exits 0 rather than dying of (or raising KeyboardInterrupt for) it
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
