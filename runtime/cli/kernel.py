"""``lmc kernel``: compile one kernel on its own, check it, time it, try
variants (the lab itself: ``runtime.tools.kernel_lab``). Exit status 0, or 1 when a kernel
gave wrong numbers; bad input is one line on stderr and 2."""
from __future__ import annotations

import argparse
import json
import re
import sys

from compiler.host_cores import usable_cores

from .common import thread_count, whole_number
from ..tools.kernel_lab import (DEFAULT_REPEATS, KINDS, SWEEP_REPEATS, KernelLabError, Params, Problem, format_sweep,
                         format_text, lab, parse_tile, show, sweep)


def add_parser(sub) -> None:
    kn = sub.add_parser("kernel", help="compile one kernel on its own: check it, time it, try variants")
    add_arguments(kn)
    kn.add_argument("-t", "--threads", type=thread_count, default=None, help="threads (default: the cores this process may use: its affinity mask and CPU quota)")


def add_arguments(k: argparse.ArgumentParser) -> None:
    """The options of ``lmc kernel`` (``-t`` is added by the caller)."""
    k.add_argument("kind", choices=KINDS, help="the kernel: a matrix product (matvec, matmul, qmatvec, qmatmul) "
                                                "or rmsnorm, rope, attention, softmax")
    k.add_argument("--qtype", default=None, help="weight layout of qmatvec/qmatmul (Q4_K, Q8_0, L2C_Q8G64 ...)")
    k.add_argument("--rows", type=_positive("--rows"), required=True,
                   help="weight rows (matrix kinds), rows (rmsnorm, rope, softmax), context positions (attention)")
    k.add_argument("--cols", type=_positive("--cols"), required=True,
                   help="columns: the row length, or heads x head_dim (rope, attention)")
    k.add_argument("--batch", type=_positive("--batch"), default=None,
                   help="tokens (matmul, qmatmul; default 16) or query tokens (attention; default 1)")
    k.add_argument("--vector-width", type=int, default=None, help="float32 lanes per vector (4, 8, 16; "
                                                                  "default: the host's)")
    k.add_argument("--unroll", type=_positive("--unroll"), default=None,
                   help="vectors per step / accumulators (matrix kinds, rmsnorm, softmax), "
                        "positions per block (attention)")
    k.add_argument("--tile", default=None, help="rows per tile, or ROWSxTOKENS for matmul/qmatmul on a batch")
    dot = k.add_mutually_exclusive_group()
    dot.add_argument("--int-dot", dest="int_dot", action="store_const", const=True, default=None,
                     help="integer dot path: x quantized per block, int8 dot products (Q8_0/Q4_0/Q5_0/Q4_1/Q5_1)")
    dot.add_argument("--float-dot", dest="int_dot", action="store_const", const=False,
                     help="float dot path (weights decoded to float32 in registers)")
    k.add_argument("--prefetch", type=whole_number("--prefetch", 0), default=None,
                   help="integer path: bytes ahead of the weights in use to prefetch (0: none)")
    k.add_argument("--head-dim", type=_positive("--head-dim"), default=None,
                   help="rope/attention head size (default 64)")
    k.add_argument("--kv-heads", type=_positive("--kv-heads"), default=None,
                   help="attention KV heads (default: as many as query heads)")
    k.add_argument("--style", choices=["interleaved", "neox"], default=None, help="rope pairing (default interleaved)")
    k.add_argument("--hot", action="store_true",
                   help="time the matrix kinds with the weight in cache (default: read from memory, as decode)")
    k.add_argument("--repeats", type=_positive("--repeats"), default=None,
                   help=f"timed batches (default {DEFAULT_REPEATS}, {SWEEP_REPEATS} per variant with --sweep)")
    k.add_argument("--seed", type=int, default=0, help="random data seed")
    k.add_argument("--show", choices=["ir", "asm"], default=None,
                   help="print the kernel's LLVM IR or assembly instead of running it")
    k.add_argument("--sweep", action="store_true", help="try a small grid of parameters and print the best")
    k.add_argument("--json", action="store_true", help="print one JSON object")


def _positive(flag: str):
    return whole_number(flag, 1)


def run(args: argparse.Namespace) -> int:
    rows, tokens = parse_tile(args.tile) if args.tile is not None else (None, None)
    if args.style is not None and args.kind != "rope":
        raise KernelLabError(f"--style is for rope, not {args.kind}")
    batch = args.batch if args.batch is not None else (16 if args.kind in ("matmul", "qmatmul") else 1)
    qtype = args.qtype.upper() if args.qtype else None
    if qtype and re.fullmatch(r".+X(8|16)", qtype):   # a repacked layout: Q5_0x16
        qtype = qtype[:qtype.rindex("X")] + "x" + qtype[qtype.rindex("X") + 1:]
    p = Problem(args.kind, args.rows, args.cols, batch, qtype, args.threads or usable_cores(),
                args.head_dim, args.kv_heads, args.style or "interleaved", args.seed, args.hot)
    prm = Params(args.vector_width, args.unroll, rows, tokens, args.int_dot, args.prefetch)
    if args.show:
        if args.sweep or args.json:
            raise KernelLabError("--show prints code only: leave out --sweep and --json")
        sys.stdout.write(show(p, prm, args.show))
        return 0
    if args.sweep:
        tty = sys.stderr.isatty() and not args.json
        progress = (lambda s: sys.stderr.write(f"\r{s} ")) if tty else None
        r = sweep(p, prm, args.repeats or SWEEP_REPEATS, progress)
        if tty:
            sys.stderr.write("\r" + " " * 30 + "\r")
        sys.stdout.write(json.dumps(r) + "\n" if args.json else format_sweep(r))
        return 0 if r["best"] is not None and r["all_correct"] else 1
    r = lab(p, prm, args.repeats or DEFAULT_REPEATS)
    sys.stdout.write(json.dumps(r) + "\n" if args.json else format_text(r))
    return 0 if r["correct"] else 1
