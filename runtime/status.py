"""One status line on a terminal, for the slow first steps of a cold start.

Reading a large vocabulary the first time, or compiling for this CPU, takes
seconds; a silent terminal looks hung. The line says what is happening and
how long it has taken (a ticker thread redraws it), and is cleared before
the first token is printed. When stderr is not a terminal it prints nothing.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import TextIO


class StatusLine:
    def __init__(self, stream: TextIO | None = None, enabled: bool | None = None, interval: float = 0.1) -> None:
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.interval = interval
        self._text = ""
        self._t0 = 0.0
        self._lock = threading.Lock()
        self._shown = False
        self._ticker: threading.Thread | None = None
        self._stop = threading.Event()

    def __call__(self, text: str) -> None:
        """Show ``text`` (with its elapsed time, ticking) until the next call or ``clear``."""
        if not self.enabled:
            return
        with self._lock:
            self._text, self._t0 = text, time.monotonic()
            self._draw()
        if self._ticker is None:
            self._stop.clear()
            self._ticker = threading.Thread(target=self._tick, name="lmc-status", daemon=True)
            self._ticker.start()

    def update(self, text: str) -> None:
        """Show ``text`` without restarting the clock (progress within one step)."""
        if not self.enabled:
            return
        if not self._text:
            self(text)
            return
        with self._lock:
            self._text = text
            self._draw()

    def _draw(self) -> None:
        elapsed = time.monotonic() - self._t0
        tail = f" … {elapsed:.1f} s" if elapsed >= 0.5 else " …"
        self.stream.write(f"\r\x1b[2K{self._text}{tail}")
        self.stream.flush()
        self._shown = True

    def _tick(self) -> None:
        while not self._stop.wait(self.interval):
            with self._lock:
                if self._text:
                    self._draw()

    def clear(self) -> None:
        """Erase the line (before the first token, or when done)."""
        if not self.enabled:
            return
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=1)
            self._ticker = None
        with self._lock:
            if self._shown:
                self.stream.write("\r\x1b[2K")
                self.stream.flush()
            self._text, self._shown = "", False


def quiet(_: str) -> None:
    """A status sink that shows nothing (the default)."""
