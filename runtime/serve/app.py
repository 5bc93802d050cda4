"""The HTTP side: an OpenAI-compatible API on FastAPI, assembled from the
routes (``routes_info``, ``routes_tokens``, ``routes_chat``,
``routes_completions``) over a backend (``backend.ServingBackend``).

Each request is rendered (chat template) and tokenized off the event loop,
handed to the backend with a callback that puts its events on an asyncio
queue, and answered whole or streamed as server-sent events ending in
``data: [DONE]``. A client that goes away cancels its request and frees
its KV blocks. Every refusal is a 4xx with an OpenAI-style JSON error
(``errors``), and the server stays up. The routes hold no state of their
own: another app (a deployment with replicas) can mount the same routers
over its own backend. With ``webui`` (the default) it also serves the chat
page at ``/`` (``routes_webui``), whose files load without the API key.
"""
from __future__ import annotations

from typing import Any, Callable

from fastapi import APIRouter, FastAPI, HTTPException, Request as HttpRequest
from fastapi.responses import Response

from .backend import ServingBackend
from .errors import error_response, install_error_handlers
from .routes_chat import router as chat_router
from .routes_completions import router as completions_router
from .routes_info import router as info_router
from .routes_tokens import router as tokens_router
from .routes_webui import install_viz, install_webui, is_public

#: request bodies larger than this are refused (413) before they are read whole
MAX_BODY_BYTES = 8 << 20

#: every route of the API, to mount on an app whose ``state.backend`` serves them
ROUTERS: tuple[APIRouter, ...] = (info_router, tokens_router, chat_router, completions_router)


def create_app(backend: ServingBackend, api_key: str | None = None, webui: bool = True,
               viz: Callable[[], Any] | None = None) -> FastAPI:
    """The API over ``backend``; ``api_key``: required on every endpoint but
    /health (and the pages' files); ``webui``: serve the chat page at /;
    ``viz``: with ``webui``, the compiler viewer at /viz/ over the session
    ``viz()`` builds at its first request (``runtime.tools.viz``)."""
    app = FastAPI(title="lmc", docs_url=None, redoc_url=None)
    app.state.backend = backend
    install_error_handlers(app, backend)
    # added before the guard below, so inside it: its refusal is raised in the route's own read
    # of the body, where the error handlers turn it into our JSON 413
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)

    @app.middleware("http")
    async def _guard(request: HttpRequest, call_next: Callable) -> Response:
        size = request.headers.get("content-length")
        if size is not None and not size.isdigit():
            backend.count_error(400)
            return error_response(400, f"Content-Length {size[:40]!r} is not a number")
        if size is not None and int(size) > MAX_BODY_BYTES:
            backend.count_error(413)
            return error_response(413, f"the request body is larger than {MAX_BODY_BYTES >> 20} MiB")
        path = request.url.path
        if api_key is not None and path != "/health" and not (webui and is_public(path)):
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                backend.count_error(401)
                return error_response(401, "invalid or missing API key (Authorization: Bearer KEY)",
                                      kind="authentication_error")
        return await call_next(request)

    for router in ROUTERS:
        app.include_router(router)
    if webui:
        install_webui(app)
        if viz is not None:
            install_viz(app, viz)
    return app


class BodyLimit:
    """ASGI middleware: a body is counted as it arrives and refused (413)
    once past ``limit``. The guard's Content-Length check alone let a body
    sent chunked (no Content-Length) through: 50 MB were read and tokenized
    whole before a 400. (FastAPI 0.165's own ``max_body_size`` answers a
    Content-Length over it in plain text, outside our error handlers.)"""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        seen = 0

        async def counted() -> dict:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    # an HTTPException: FastAPI passes it on from its read of the body (others become a 400)
                    raise HTTPException(413, f"the request body is larger than {self.limit >> 20} MiB")
            return msg

        await self.app(scope, counted, send)
