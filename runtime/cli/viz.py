"""``lmc viz``: the compiler in the browser: every pass's graph, what it
changed, each node's kernel as IR, assembly and llvm-mca analysis, the
memory plan and, with ``--profile``, time per node (the viewer:
``runtime.tools.viz``; its API: ``runtime.tools.viz.app``)."""
from __future__ import annotations

import argparse
import signal
import sys

from ..errors import RunError
from ..status import StatusLine
from .common import kv_type_arg, memory_args, model_args, native_options, port_number, thread_count


def add_parser(sub) -> None:
    v = sub.add_parser("viz", help="show every compiler pass, its graph and each node's kernel in the browser")
    model_args(v)
    v.add_argument("--mode", choices=["decode", "prefill"], default="decode", help="which graph (default decode)")
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    v.add_argument("--port", type=port_number(), default=0,
                   help="port (default 0: a free one; the URL is the first line printed)")
    v.add_argument("--no-open", action="store_true", help="do not open a browser")
    v.add_argument("--profile", action="store_true",
                   help="also time every node (lmc profile) and show the times on the graph")
    v.add_argument("-c", "--ctx", type=int, default=None, help="context length (default: the model's, at most 4096)")
    v.add_argument("-t", "--threads", type=thread_count, default=None,
                   help="threads of the profile and of the memory plan (default: the cores)")
    kv_type_arg(v)
    memory_args(v)
    v.add_argument("--no-cache", action="store_true", help="with --profile: do not use the compile cache")


class _Stop(Exception):
    """SIGTERM while the viewer is still being built."""


def _stop(*_) -> None:
    raise _Stop


def run(args: argparse.Namespace) -> int:
    from compiler.driver import load_model

    from ..loading import DEFAULT_CTX
    from ..tools.viz.server import bind, open_browser, serve, url_of

    sock = bind(args.host, args.port)   # before the slow part: a taken port fails at once
    if args.host not in ("127.0.0.1", "localhost", "::1"):   # (a host that binds)
        print(f"lmc viz: warning: listening on {args.host}: anyone who can reach it sees the model's graph and "
              "file paths", file=sys.stderr)
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        app = _build(args, load_model, DEFAULT_CTX)
    except (_Stop, KeyboardInterrupt):
        sock.close()
        print("lmc viz: stopped", flush=True)
        return 0
    except BaseException:
        sock.close()
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    url = url_of(sock)

    def ready() -> None:
        print(f"lmc viz: {url}", flush=True)
        if not args.no_open:
            open_browser(url, lambda msg: print(f"lmc viz: {msg}", file=sys.stderr, flush=True))

    serve(app, sock, on_ready=ready)
    print("lmc viz: stopped", flush=True)
    return 0


def _build(args: argparse.Namespace, load_model, default_ctx: int):
    """Load, plan, record the passes (and profile): the app to serve."""
    from ..tools.viz.app import create_app
    from ..tools.viz.session import VizOptions, build_session

    m = load_model(args.model, args.tokenizer)
    if args.ctx is not None and not 0 < args.ctx <= m.config.seq_len:
        raise RunError(f"--ctx {args.ctx}: must be between 1 and the model's context {m.config.seq_len}")
    native = native_options(args, m, default_ctx)
    native.use_cache = not args.no_cache
    opts = VizOptions(args.model, args.tokenizer, args.mode, native, profile=args.profile, threads=args.threads)
    status = StatusLine()   # on a terminal, and cleared: an error stays the one line on stderr
    try:
        session = build_session(m, opts, progress=lambda s: status(f"lmc viz: {s}"))
    finally:
        status.clear()
    return create_app(session)
