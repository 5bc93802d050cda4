"""``lmc profile``: time every kernel of a decode step and a prefill (the
measurement and its report: ``runtime.tools.profile_report``)."""
from __future__ import annotations

import argparse
import sys

from frontends.output_file import write_atomic

from .common import model_args, positive_or_zero, resolve_model, thread_count


def add_parser(sub) -> None:
    f = sub.add_parser("profile", help="time every kernel of a decode step and a prefill")
    model_args(f, optional=True)
    f.add_argument("-t", "--threads", type=thread_count, default=None, help="threads (default: the cores this process may use: its affinity mask and CPU quota)")
    f.add_argument("--steps", type=positive_or_zero("--steps"), default=32, help="decode steps timed (default 32)")
    f.add_argument("--prompt-tokens", type=positive_or_zero("--prompt-tokens"), default=64,
                   help="random prompt length of the timed prefill (default 64)")
    f.add_argument("-c", "--ctx", type=int, default=None, help="context length (default: the model's, at most 4096)")
    f.add_argument("--format", choices=["text", "json", "svg"], default="text",
                   help="text: tables per op kind and the slowest nodes; json: everything; svg: a chart")
    f.add_argument("--top", type=positive_or_zero("--top"), default=15, help="nodes listed in the text (default 15)")
    f.add_argument("-o", "--output", default=None, help="write to this file instead of stdout")
    f.add_argument("--no-cache", action="store_true", help="do not use the compile cache")


def run(args: argparse.Namespace) -> int:
    from ..tools import profile_report

    model_path, tok_path = resolve_model(args)
    report = profile_report.profile_model(model_path, tok_path, threads=args.threads, steps=args.steps,
                                          prompt_tokens=args.prompt_tokens, ctx=args.ctx,
                                          use_cache=not args.no_cache)
    out = profile_report.render(report, args.format, args.top)
    if args.output:
        write_atomic(args.output, out)
    else:
        sys.stdout.write(out)
    return 0
