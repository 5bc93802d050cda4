"""``lmc plan``: the memory map of a model under a budget (the report: ``runtime.tools.plan_report``)."""
from __future__ import annotations

import argparse
import sys

from frontends.output_file import write_atomic

from ..errors import RunError
from .common import kv_type_arg, memory_args, model_args, native_options, thread_count


def add_parser(sub) -> None:
    pl = sub.add_parser("plan", help="the memory map of a model under a budget")
    model_args(pl)
    pl.add_argument("-c", "--ctx", type=int, default=None, help="context length (default: the model's, at most 4096)")
    pl.add_argument("-t", "--threads", type=thread_count, default=None, help="threads (scratch is per thread)")
    kv_type_arg(pl)
    memory_args(pl)
    pl.add_argument("--format", choices=["text", "json", "svg"], default="text",
                    help="text: categories and totals; json: everything; svg: the decode arena plan")
    pl.add_argument("-o", "--output", default=None, help="write to this file instead of stdout")


def run(args: argparse.Namespace) -> int:
    from compiler.driver import load_model

    from ..loading import DEFAULT_CTX
    from ..tools import plan_report

    m = load_model(args.model, args.tokenizer)
    if args.ctx is not None and not 0 < args.ctx <= m.config.seq_len:
        raise RunError(f"--ctx {args.ctx}: must be between 1 and the model's context {m.config.seq_len}")
    r = plan_report.memory_report(m, native_options(args, m, DEFAULT_CTX))
    text = {"text": plan_report.format_text, "json": plan_report.format_json,
            "svg": plan_report.format_svg}[args.format](r)
    if args.output:
        write_atomic(args.output, text)
    else:
        sys.stdout.write(text)
    return 0
