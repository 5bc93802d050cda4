"""``lmc perplexity``: sliding-window perplexity of a text file (the
computation: ``runtime.perplexity``)."""
from __future__ import annotations

import sys

from ..errors import RunError
from ..perplexity import perplexity
from .common import exec_args, kv_type_arg, model_args, resolve_model


def add_parser(subparsers) -> None:
    """Add ``perplexity`` to the ``lmc`` sub-commands."""
    p = subparsers.add_parser("perplexity", help="sliding-window perplexity of a text file")
    model_args(p, optional=True)
    p.add_argument("--text", required=True, metavar="FILE", help="UTF-8 text file to score")
    p.add_argument("-c", "--ctx", type=int, default=None,
                   help="window length in tokens (default: the model's context, at most 4096)")
    p.add_argument("--stride", type=int, default=None, help="tokens between window starts (default: ctx/2)")
    kv_type_arg(p)
    exec_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args) -> int:
    """Check the cheap arguments before loading (which may compile), then score."""
    import json
    import os

    from ..api import load

    if args.ctx is not None and args.ctx < 2:
        raise RunError(f"-c/--ctx {args.ctx}: a window needs at least 2 tokens")
    if args.stride is not None and (args.stride <= 0 or (args.ctx is not None and args.stride > args.ctx)):
        raise RunError(f"--stride {args.stride}: must be between 1 and the window length"
                       + (f" (ctx {args.ctx})" if args.ctx is not None else ""))
    with open(args.text, encoding="utf-8", errors="strict") as f:
        try:
            text = f.read()
        except UnicodeDecodeError as e:
            raise RunError(f"{args.text}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not text.strip():
        raise RunError(f"{args.text}: the text file is empty")
    model_path, tok_path = resolve_model(args)
    model = load(model_path, tok_path, backend=args.backend, ctx=args.ctx, threads=args.threads,
                 use_cache=not args.no_cache, kv_type=args.kv_type)
    res = perplexity(model, text, args.ctx, args.stride, progress=sys.stderr.isatty())
    if args.json:
        print(json.dumps({"model": os.path.basename(model_path), "text": args.text, "backend": model.backend,
                          "kv_type": model.kv_type,
                          **{k: v for k, v in model.compile_info.items() if k.startswith("key_offsets")},
                          **res.as_dict()}))
    else:
        sys.stdout.write(res.format_text(f"{os.path.basename(model_path)} on {args.text} ({model.backend}, KV cache "
                                         f"{model.kv_type})"))
    return 0
