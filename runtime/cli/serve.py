"""``lmc serve``: an OpenAI-compatible server with continuous batching
(assembled by ``runtime.serve.server``).

One engine thread runs the model's paged batch steps (``runtime.engine``)
for every request at once; FastAPI on uvicorn answers HTTP and streams
tokens as they come. With ``--draft MODEL`` or ``--draft-layers K`` (as
llama.cpp's ``--model-draft``), one drafter built at startup proposes tokens
for every request that does not turn it off (``draft_max`` 0) or ask for
prompt lookup (``lookup``); the step checks them (``runtime.speculative``).
It binds to 127.0.0.1 unless ``--host`` says otherwise. Ctrl-C or SIGTERM
drains: new requests get 503, running ones finish (or are cut after
``--drain-timeout`` seconds, with their finish reason set), then the
process exits.
"""
from __future__ import annotations

import argparse
import os
import sys

from ..loading import DEFAULT_CTX
from ..speculative import DEFAULT_DRAFT_MAX, Speculation
from ..status import StatusLine
from .common import CliError, exec_args, kv_type_arg, model_args, number_in, port_number, resolve_model, size_arg, whole_number


def add_parser(sub) -> None:
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (continuous batching, paged KV cache)")
    model_args(s, optional=True)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=port_number(), default=8080,
                   help="port (default 8080; 0 picks a free one and prints it)")
    s.add_argument("-np", "--parallel", type=whole_number("--parallel", 1), default=4,
                   help="sequences advanced together in one step (default 4)")
    s.add_argument("-c", "--ctx", type=whole_number("-c", 1), default=None,
                   help=f"the longest a single request may be, prompt and reply (default: the model's context, "
                        f"at most {DEFAULT_CTX}); not split between requests")
    s.add_argument("--kv-pool", type=whole_number("--kv-pool", 1), default=None, metavar="POSITIONS",
                   help="KV cache positions shared by all requests (default: --parallel times the context; "
                        "with --mem-budget: what fits)")
    s.add_argument("--block-size", type=whole_number("--block-size", 1), default=16,
                   help="positions per KV block (default 16)")
    s.add_argument("--mem-budget", type=size_arg, default=None, metavar="SIZE",
                   help="peak resident memory for the server (1G, 800M ...): the KV pool gets what is left")
    s.add_argument("--queue", type=whole_number("--queue", 0), default=64,
                   help="requests that may wait beyond --parallel (default 64); more get 503")
    s.add_argument("--prefill-chunk", type=whole_number("--prefill-chunk", 1), default=64,
                   help="prompt tokens run per step beside the others' tokens (default 64)")
    s.add_argument("--api-key", type=_api_key, default=os.environ.get("LMC_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: "
                        "$LMC_API_KEY, else none)")
    s.add_argument("--no-webui", dest="webui", action="store_false",
                   help="do not serve the chat page at / (by default a browser opened on the server's URL "
                        "chats with the model)")
    s.add_argument("--alias", default=None, help="the model's id in the API (default: the file's name)")
    s.add_argument("--chat-template", default=None, metavar="FILE|NAME",
                   help="a jinja template file, or chatml, llama2, llama3, gemma, phi3, plain (default: the "
                        "model's own, else plain)")
    s.add_argument("--drain-timeout", type=number_in("--drain-timeout", lambda v: 0 <= v <= 86400,
                                                     "between 0 and 86400 seconds", "seconds"),
                   default=30.0, metavar="S",
                   help="on Ctrl-C/SIGTERM, seconds running requests may take to finish (default 30)")
    s.add_argument("--log-requests", action="store_true", help="log every HTTP request to stderr")
    s.add_argument("--lookup", type=whole_number("--lookup", 0), default=0, metavar="N",
                   help="prompt lookup decoding for every request (n-gram length N; 0: off, the default; a "
                        "request's own 'lookup' field wins): tokens its history proposes are checked as rows of "
                        "the step while the step has room; greedy output is unchanged")
    s.add_argument("--draft", default=None, metavar="MODEL",
                   help="speculative decoding with a smaller model of the same vocabulary for every request (its "
                        "own KV pool, addressed as the model's; a request's 'draft_max' 0 turns it off): drafted "
                        "tokens are checked as rows of the step; greedy output is unchanged")
    s.add_argument("--draft-tokenizer", default=None, metavar="FILE",
                   help="with --draft: the draft's tokenizer file (llama2.c models)")
    s.add_argument("--draft-layers", type=whole_number("--draft-layers", 1), default=None, metavar="K",
                   help="as --draft, the draft being the model's own first K layers, final norm and head (its "
                        "weights and KV pool)")
    s.add_argument("--draft-max", type=whole_number("--draft-max", 1), default=DEFAULT_DRAFT_MAX, metavar="N",
                   help=f"with a drafter: tokens drafted per step at most (default {DEFAULT_DRAFT_MAX}; a request's "
                        f"'draft_max' wins); the step is compiled for --parallel plus this many rows")
    c = s.add_argument_group("across processes and machines (Ray Serve: pip install -e '.[cluster]')")
    c.add_argument("--replicas", type=whole_number("--replicas", 1), default=None, metavar="N",
                   help="N engine replicas on Ray Serve behind this server (the same API), each a whole engine "
                        "with its KV pool and -t threads; requests go to the replica whose KV cache holds the "
                        "longest part of their prompt, or the least loaded when loads are uneven")
    c.add_argument("--autoscale", type=_min_max, default=None, metavar="MIN:MAX",
                   help="as --replicas, scaled between MIN and MAX on the requests each replica is running")
    c.add_argument("--ray-address", default=None, metavar="ADDRESS",
                   help="with --replicas/--autoscale: join this Ray cluster (default: $RAY_ADDRESS, else a local "
                        "Ray on 127.0.0.1)")
    c.add_argument("--routing", choices=("cache", "power-of-two"), default="cache",
                   help="with --replicas/--autoscale: cache (default: the replica holding the longest part of "
                        "the prompt in its KV cache, unless loads are uneven) or power-of-two (Ray Serve's "
                        "default: the less loaded of two replicas drawn at random)")
    c.add_argument("--downscale-delay", type=float, default=60.0, metavar="S",
                   help="with --autoscale: seconds of low load before a replica is removed (default 60)")
    s.add_argument("--context-shift", action="store_true",
                   help="a request that fills the context goes on to its max_tokens: its first n_keep tokens stay "
                        "(the request's 'n_keep'; default: a chat's system prompt, else 0), the oldest half of the "
                        "rest goes and it is recomputed at the new positions; a prompt longer than the context is "
                        "shifted to fit; usage reports context_shifts and shifted_tokens (default: off, such a "
                        "request ends with finish reason length, a too long one is refused)")
    kv_type_arg(s)
    exec_args(s)


def _min_max(text: str) -> tuple[int, int]:
    """``--autoscale MIN:MAX`` (1 <= MIN <= MAX)."""
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--autoscale takes MIN:MAX (two whole numbers), not {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"--autoscale {text}: needs 1 <= MIN <= MAX")
    return lo, hi


def _api_key(text: str) -> str:
    """A key a client can send: an empty one (``--api-key "$KEY"`` with KEY unset) would
    quietly leave the server open."""
    if not text.strip():
        raise argparse.ArgumentTypeError("--api-key is empty (give a key, or leave the flag out to "
                                         "require none)")
    if any(c.isspace() or not c.isprintable() for c in text):
        raise argparse.ArgumentTypeError("--api-key may not contain spaces or control characters "
                                         "(it is sent as 'Authorization: Bearer KEY')")
    return text


def run(args: argparse.Namespace) -> int:
    from ..serve.server import ServerOptions, bind_socket, build_serving, serve

    spec = _speculation(args)
    if not (args.replicas or args.autoscale):
        for flag, given in (("--ray-address", args.ray_address is not None), ("--routing", args.routing != "cache"),
                            ("--downscale-delay", args.downscale_delay != 60.0)):
            if given:
                raise CliError(f"{flag} goes with --replicas or --autoscale")
    elif args.downscale_delay <= 0:
        raise CliError(f"--downscale-delay {args.downscale_delay:g}: must be > 0")
    sock = bind_socket(args.host, args.port)   # before the slow part: a taken port fails at once
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:   # (a host that binds)
        print(f"lmc serve: warning: listening on {args.host} without --api-key", file=sys.stderr)
    model_path, tok_path = resolve_model(args)
    opts = ServerOptions(model_path, tok_path, ctx=args.ctx, parallel=args.parallel, kv_pool=args.kv_pool,
                         block_size=args.block_size, mem_budget=args.mem_budget, queue=args.queue,
                         prefill_chunk=args.prefill_chunk, kv_type=args.kv_type, backend=args.backend,
                         threads=args.threads, use_cache=not args.no_cache, alias=args.alias,
                         chat_template=args.chat_template, api_key=args.api_key, lookup=args.lookup,
                         draft_max=args.draft_max, speculation=spec, webui=args.webui,
                         context_shift=args.context_shift)
    status = StatusLine()
    try:
        serving = _cluster(args, opts, status) if args.replicas or args.autoscale else build_serving(opts, status)
    finally:
        status.clear()
    host, port = sock.getsockname()[:2]
    serve(serving, sock, args.drain_timeout, args.log_requests,
          on_ready=lambda: print(serving.banner(host, port), flush=True))
    print("lmc serve: stopped", flush=True)
    return 0


def _cluster(args: argparse.Namespace, opts, status):
    """The replicas on Ray Serve and the ingress app (``runtime.cluster``)."""
    if args.replicas and args.autoscale:
        raise CliError("--replicas and --autoscale: one or the other")
    try:
        from ..cluster.deploy import ClusterOptions, build_cluster
    except ImportError as e:
        raise CliError(f"--replicas/--autoscale need Ray Serve, which is not installed ({e.name}): "
                       f"pip install -e '.[cluster]'") from None
    return build_cluster(opts, ClusterOptions(replicas=args.replicas, autoscale=args.autoscale,
                                              ray_address=args.ray_address, routing=args.routing,
                                              downscale_delay_s=args.downscale_delay), status)


def _speculation(args: argparse.Namespace) -> Speculation | None:
    """The server's model drafter (``--draft`` or ``--draft-layers``), or None."""
    if args.draft is not None and args.draft_layers is not None:
        raise CliError("one drafter at a time: --draft and --draft-layers")
    if args.draft_tokenizer is not None and args.draft is None:
        raise CliError("--draft-tokenizer goes with --draft MODEL")
    if args.draft is None and args.draft_layers is None:
        return None
    if args.mem_budget is not None:
        raise CliError("--mem-budget does not count a drafter's memory yet: use --kv-pool with --draft or "
                       "--draft-layers")
    return Speculation(draft=args.draft, draft_layers=args.draft_layers or 0, draft_max=args.draft_max,
                       draft_tokenizer=args.draft_tokenizer)
