"""The chat page: ``GET /`` is ``webui/index.html`` and ``/webui/...`` its
script, style and vendored libraries, all files of the package (no CDN, so
it works offline). The page is plain HTML and JavaScript talking to the
same API as any client (``/v1/models``, ``/v1/chat/completions``); it holds
no secret, so it loads without the API key (``is_public``) and asks the
user for the key, which it then sends on every API call.

With a viewer (``install_viz``), ``/viz/`` is ``lmc viz``'s page for the
served model: its page and files load without the key too, its JSON API
(``/viz/api/...``) needs it (the page sends the key the chat page stored)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from fastapi import FastAPI
from fastapi.responses import FileResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

#: the page's files, shipped as package data (pyproject.toml)
WEBUI_DIR = Path(__file__).resolve().parent / "webui"

#: where the page's assets are served
ASSETS_PREFIX = "/webui"

#: where the compiler viewer is mounted (its page, ``static/`` and ``api/`` below)
VIZ_PREFIX = "/viz"

#: the page runs only its own scripts, talks only to this server and shows
#: no image from elsewhere: model output is untrusted, and an image from
#: another host could carry the conversation away in its URL
CONTENT_SECURITY_POLICY = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                           "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'")


def is_public(path: str) -> bool:
    """Whether ``path`` is one of the page's files (loaded without the API key)."""
    return (path == "/" or path.startswith(ASSETS_PREFIX + "/")
            or path in (VIZ_PREFIX, VIZ_PREFIX + "/") or path.startswith(VIZ_PREFIX + "/static/"))


def install_webui(app: FastAPI) -> None:
    """Serve the chat page on ``app``: ``/`` and ``/webui/...``."""
    if not (WEBUI_DIR / "index.html").is_file():
        raise FileNotFoundError(f"the chat page is missing from the installed package: {WEBUI_DIR}/index.html")

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        # no-cache: a browser revalidates the page, so a new lmc's page (and
        # the asset names it links) is seen at the next load
        return FileResponse(WEBUI_DIR / "index.html", media_type="text/html; charset=utf-8",
                            headers={"Cache-Control": "no-cache", "Content-Security-Policy": CONTENT_SECURITY_POLICY,
                                     "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"})

    app.mount(ASSETS_PREFIX, _Assets(directory=WEBUI_DIR), name="webui")


def install_viz(app: FastAPI, build: Callable[[], Any]) -> None:
    """Serve the compiler viewer at ``/viz/`` (``/viz`` redirects there) over
    the ``Session`` ``build()`` makes at the first request."""
    from ..tools.viz.app import LazyViewer

    @app.get(VIZ_PREFIX, include_in_schema=False)
    async def viz_redirect() -> RedirectResponse:
        return RedirectResponse("viz/", status_code=307)   # relative: also right behind a proxy's prefix

    app.mount(VIZ_PREFIX, LazyViewer(build), name="viz")


class _Assets(StaticFiles):
    """Starlette's static files, revalidated at every load (by their ETag):
    an upgraded lmc's script is never mixed with an old cached page."""

    def file_response(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        response = super().file_response(*args, **kwargs)
        response.headers["Cache-Control"] = "no-cache"
        response.headers["X-Content-Type-Options"] = "nosniff"
        return response
