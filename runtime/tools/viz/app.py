"""The viewer's HTTP app: the page (``static/``) and the JSON API it reads.

Every answer is computed from the ``Session`` (steps recorded at start);
pictures and kernels are made on first request and kept in memory.

API (``STEP`` is a step's number, 0 being the frontend's graph, or its
pass's name; ``NODE`` the name of the value a node defines, ``12`` or ``%12``):

``GET /api/info``
    model, mode, graph name, layers, CPU and vector width, context, KV type,
    whether a profile was taken, the llvm-mca found (or null), step count.
``GET /api/passes``
    the steps in order: ``index``, ``name``, ``doc`` (the pass's first doc
    line), ``nodes``, ``ms`` (the pass's time) and the diff's ``summary``.
``GET /api/step/STEP``
    ``nodes`` (name, op, label, layer, index, type), ``overview_peers``
    (block 0's node -> the same node in every block), ``diff`` (against
    the step before: ``summary``, ``removed``, ``added``, ``fused`` with
    the nodes each ``absorbed``, ``changed``, ``moved``) and ``last``.
``GET /api/graph/STEP.svg?view=overview|layer|all&layer=N``
    the picture (``ir.dot``, drawn by Graphviz); ``layer`` with ``view=layer``.
``GET /api/node/STEP/NODE``
    the node: op, ``inputs`` and ``output`` (type, dtype, shape, layout,
    producer), ``attrs``, ``kernel_choices``, ``layer``, ``readers``, the
    kernel ``signature``, ``in_diff`` (how this step's pass changed it) and,
    when weights stream, its ``stream_segments``.
``GET /api/kernel/STEP/NODE``
    its kernel: ``ir`` (as emitted), ``ir_optimized``, ``asm`` for this CPU,
    ``tuning`` and ``mca`` (llvm-mca's report, or ``available: false`` and
    the ``reason``); ``available: false`` and ``reason`` for an op with no
    native kernel (``dequant`` before ``fuse_dequant``).
``GET /api/plan``
    the memory plan (``lmc plan``): ``text``, ``report``, ``arena_svg``
    (the decode arena) and ``stream`` (segments, their weights and the
    nodes reading them) or null when nothing streams.
``GET /api/profile``
    with ``--profile``: time per node of the last step (``nodes`` by name:
    ``us``, ``share`` ...), the slowest (``top``) and per op kind (``kinds``).

Errors are JSON ``{"error": "..."}``: 404 for a step, node, view or layer
that does not exist (and the profile when none was taken), 400 for a
malformed query, 500 when drawing fails.
"""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from ...errors import RunError
from .session import NotFound, Session

#: the page's files, shipped as package data (pyproject.toml)
STATIC_DIR = Path(__file__).resolve().parent / "static"

#: the page runs its own scripts only and talks to this server only; styles
#: may be inline because Graphviz's SVG and the pan-zoom library set them
CONTENT_SECURITY_POLICY = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                           "img-src 'self' data:; connect-src 'self'; object-src 'none'; base-uri 'none'")


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def create_app(session: Session) -> FastAPI:
    """The app serving ``session``."""
    if not (STATIC_DIR / "index.html").is_file():
        raise FileNotFoundError(f"the viewer's page is missing from the installed package: {STATIC_DIR}/index.html")
    app = FastAPI(title="lmc viz", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(NotFound)
    async def not_found(request: Request, e: NotFound) -> JSONResponse:
        return _error(404, str(e))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        return _error(e.status_code, str(e.detail))

    @app.exception_handler(RequestValidationError)
    async def bad_query(request: Request, e: RequestValidationError) -> JSONResponse:
        what = "; ".join(f"{'.'.join(str(p) for p in err['loc'][1:])}: {err['msg']}" for err in e.errors())
        return _error(400, what or "bad request")

    @app.exception_handler(RunError)
    async def cannot_draw(request: Request, e: RunError) -> JSONResponse:
        return _error(500, str(e))

    @app.get("/", include_in_schema=False)
    def index() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html; charset=utf-8",
                            headers={"Cache-Control": "no-cache", "Content-Security-Policy": CONTENT_SECURITY_POLICY})

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/api/info")
    def info() -> dict[str, Any]:
        return session.info()

    @app.get("/api/passes")
    def passes() -> list[dict[str, Any]]:
        return session.passes()

    @app.get("/api/step/{step}")
    def step(step: str) -> dict[str, Any]:
        return session.step_json(session.step(step))

    @app.get("/api/graph/{step}.svg")
    def graph(step: str, view: str = "overview", layer: int | None = None) -> Response:
        svg = session.svg(session.step(step), view, layer)
        return Response(svg, media_type="image/svg+xml")

    @app.get("/api/node/{step}/{node}")
    def node(step: str, node: str) -> dict[str, Any]:
        return session.node_json(session.step(step), node)

    @app.get("/api/kernel/{step}/{node}")
    def kernel(step: str, node: str) -> dict[str, Any]:
        return session.kernel(session.step(step), node)

    @app.get("/api/plan")
    def plan() -> dict[str, Any]:
        return session.plan()

    @app.get("/api/profile")
    def profile() -> dict[str, Any]:
        return session.profile()

    return app


class LazyViewer:
    """An ASGI app serving the viewer of a ``Session`` made by ``build()`` on
    the first request (``lmc serve`` mounts it at ``/viz``): running the
    passes takes seconds, so it runs once, in a worker thread, while later
    requests wait for it. A failure is kept and every request answers it as
    a JSON 500 (the server around it stays up)."""

    def __init__(self, build: Callable[[], Session]) -> None:
        self._build = build
        self._app: FastAPI | None = None
        self._error: str | None = None
        self._lock = asyncio.Lock()

    async def _ready(self) -> FastAPI | None:
        if self._app is None and self._error is None:
            async with self._lock:
                if self._app is None and self._error is None:
                    try:
                        self._app = create_app(await run_in_threadpool(self._build))
                    except Exception as e:   # any failure: said in the answer, never the server's end
                        self._error = f"cannot build the compiler viewer: {type(e).__name__}: {e}"
        return self._app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        app = await self._ready()
        if app is None:
            await _error(500, self._error or "cannot build the compiler viewer")(scope, receive, send)
            return
        await app(scope, receive, send)
