"""The single-process server (``lmc serve``), assembled: the model built for
batched serving with its KV pool sized for the machine (``pool``), the
drafter, the engine thread (``runtime.engine``), the API over it (``app``),
and uvicorn told that a signal means drain first."""
from __future__ import annotations

import os
import signal
import socket
from dataclasses import dataclass
from typing import Any, Callable

from compiler.driver import BatchOptions, load_model
from ir.types import DEFAULT_KV_TYPE

from ..engine import BatchModel, Engine, load_batch_model
from ..errors import RunError
from ..loading import DEFAULT_CTX
from ..speculative import DEFAULT_DRAFT_MAX, Speculation
from ..speculative.build import build_drafter, check_draft
from .app import create_app
from .backend import EngineBackend, ModelInfo
from .metrics import ServerMetrics
from .pool import PoolError, os_threads, pool_blocks


@dataclass
class ServerOptions:
    """What ``lmc serve``'s flags ask for."""

    model: str
    tokenizer: str | None = None
    #: the longest a single request may be (None: the model's, at most DEFAULT_CTX)
    ctx: int | None = None
    parallel: int = 4
    #: KV positions shared by all requests (None: ``parallel`` contexts, or what the budget leaves)
    kv_pool: int | None = None
    block_size: int = 16
    mem_budget: int | None = None
    queue: int = 64
    prefill_chunk: int = 64
    kv_type: str | None = None
    backend: str = "llvm"
    threads: int | None = None
    use_cache: bool = True
    #: the model's id in the API (None: the file's name)
    alias: str | None = None
    chat_template: str | None = None
    api_key: str | None = None
    #: prompt lookup for requests that do not say (0: off); tokens drafted per step at most
    lookup: int = 0
    draft_max: int = DEFAULT_DRAFT_MAX
    #: the model drafter for every request (``draft`` or ``draft_layers``), or None
    speculation: Speculation | None = None
    #: serve the chat page at / (``--no-webui``: off)
    webui: bool = True
    #: requests go on past the context (``--context-shift``; ``runtime.context_shift``)
    context_shift: bool = False


@dataclass
class Serving:
    """A server ready to start."""

    app: Any
    engine: Engine
    model: BatchModel
    model_id: str
    n_blocks: int
    block_size: int
    kv_type: str
    parallel: int
    #: what drafts for every request, for the banner ("" when nothing does)
    drafting: str
    #: what the app serves: the engine, tokenizer, model info and metrics
    backend: EngineBackend

    def banner(self, host: str, port: int) -> str:
        url_host = f"[{host}]" if ":" in host else host
        m = self
        return (f"lmc serve: {m.model_id} on http://{url_host}:{port} (parallel {m.parallel}, context "
                f"{m.model.ctx}, KV pool {m.n_blocks} blocks x {m.block_size} = {m.n_blocks * m.block_size} "
                f"positions {m.kv_type}, {m.model.executor.threads} threads"
                f"{', ' + m.drafting if m.drafting else ''})")


def build_serving(o: ServerOptions, status: Callable[[str], None] | None = None) -> Serving:
    """Load, size, compile and assemble everything ``o`` asks for; a
    setting that cannot work is a RunError (one line) before anything is
    compiled. ``status(text)`` hears about the slow steps."""
    loaded = load_model(o.model, o.tokenizer)
    ctx = o.ctx or min(loaded.config.seq_len, DEFAULT_CTX)
    if ctx > loaded.config.seq_len:
        raise RunError(f"-c {ctx}: more than the model's context {loaded.config.seq_len}")
    kv = o.kv_type or DEFAULT_KV_TYPE
    try:
        n_blocks = pool_blocks(loaded, ctx, o.parallel, o.block_size, kv, o.mem_budget, os_threads(o.threads))
    except PoolError as e:
        raise RunError(str(e)) from None
    if o.kv_pool is not None:
        n_blocks = -(-o.kv_pool // o.block_size)
    if n_blocks * o.block_size < ctx:   # (a budget's pool is checked by pool_blocks)
        raise RunError(f"--kv-pool {o.kv_pool}: smaller than one request of the context ({ctx})")
    spec = o.speculation
    draft_loaded = check_draft(loaded, ctx, spec, batched=True) if spec is not None else None
    model = load_batch_model(o.model, o.tokenizer, backend=o.backend, ctx=ctx, threads=o.threads,
                             use_cache=o.use_cache, kv_type=kv, status=status,
                             batch=BatchOptions(o.block_size, n_blocks,
                                                o.parallel + (o.draft_max if o.lookup or spec else 0)))
    drafter = build_drafter(model, spec, draft_loaded) if spec is not None else None
    tok = with_template(model.tokenizer, o)
    metrics = ServerMetrics()
    engine = Engine(model, o.parallel, prefill_chunk=o.prefill_chunk, metrics=metrics, max_queue=o.queue,
                    drafter=drafter, context_shift=o.context_shift)
    model_id = o.alias or os.path.splitext(os.path.basename(o.model))[0]
    drafting = drafter_text(spec, o.draft_max)
    info = ModelInfo(model_id, model.ctx, model.config.vocab_size,
                     meta={"n_ctx": model.ctx, "n_parallel": o.parallel, "kv_blocks": n_blocks,
                           "block_size": o.block_size, "kv_type": kv, "backend": o.backend,
                           "drafter": drafting or None, "context_shift": o.context_shift},
                     lookup=o.lookup, draft_max=o.draft_max, stop_ids=tuple(model.config.stop_ids),
                     context_shift=o.context_shift)
    backend = EngineBackend(engine, tok, info, metrics)
    app = create_app(backend, api_key=o.api_key, webui=o.webui, viz=viz_builder(o, ctx, kv))
    return Serving(app, engine, model, model_id, n_blocks, o.block_size, kv, o.parallel, drafting, backend)


def viz_builder(o: ServerOptions, ctx: int, kv: str) -> Callable[[], Any]:
    """What builds the compiler viewer's session of the served model (its
    decode graph at this context and KV type), when /viz/ is first asked for."""

    def build() -> Any:
        from compiler.native import NativeOptions

        from ..tools.viz.session import VizOptions, build_session

        native = NativeOptions(ctx=ctx, kv_type=kv, threads=o.threads, use_cache=o.use_cache)
        return build_session(load_model(o.model, o.tokenizer),
                             VizOptions(o.model, o.tokenizer, "decode", native, threads=o.threads))

    return build


def with_template(tok: Any, o: ServerOptions) -> Any:
    """The tokenizer with the chat template ``o`` asks for (the model's own
    by default); a broken template is an error now, not at the first request."""
    from frontends.chat_template import resolve_chat_template

    if o.chat_template is not None:
        tok.chat_template = resolve_chat_template(o.chat_template, tok.model_chat_template,
                                                  os.path.basename(o.model))
    else:
        tok.chat_template
    return tok


def drafter_text(spec: Speculation | None, draft_max: int) -> str:
    if spec is None:
        return ""
    what = f"draft {os.path.basename(spec.draft)}" if spec.draft is not None else \
        f"draft-layers {spec.draft_layers}"
    return f"{what}, draft-max {draft_max}"


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound now so that a taken port or a bad
    address is one clear line before the model loads."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise RunError(f"--host {host}: {e.strerror}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise RunError(f"--host {host} --port {port}: cannot listen there ({e.strerror})") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(serving: Serving, sock: socket.socket, drain_timeout: float, log_requests: bool = False,
          on_ready: Callable[[], None] | None = None) -> None:
    """Run the engine and the HTTP server on ``sock`` until a signal has
    drained it: new requests get 503, running ones finish (or are cut after
    ``drain_timeout`` seconds, with their finish reason set). ``on_ready()``
    once the engine runs (the banner)."""
    import uvicorn

    engine = serving.engine
    engine.start()
    if on_ready is not None:
        on_ready()

    class DrainingServer(uvicorn.Server):
        """uvicorn's server, told that a signal means drain first: the engine
        refuses new work and cuts what is left after the grace period, so
        open streams end and uvicorn's own graceful shutdown completes."""

        def handle_exit(self, sig, frame) -> None:
            engine.drain(drain_timeout)
            super().handle_exit(sig, frame)

    server = DrainingServer(uvicorn.Config(serving.app, log_level="info" if log_requests else "warning",
                                           access_log=log_requests))
    # uvicorn handles SIGINT/SIGTERM while it serves, then re-raises the
    # signal to the handler it found: make that one a no-op, so a drained
    # server exits 0 rather than dying of the signal it already handled
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        server.run(sockets=[sock])
    finally:
        engine.stop()
        sock.close()
