"""The memory flags shared by ``run``, ``compile``, ``bench`` and ``plan``."""
from __future__ import annotations

import argparse

from passes.memory_budget import BudgetError, parse_size


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except BudgetError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def memory_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mem-budget", type=_size, default=None, metavar="SIZE",
                   help="peak resident memory for the whole process (200M, 1.5G ...): weights that do not fit "
                        "stream from disk, the KV cache shrinks to fit")
    p.add_argument("--stream", choices=["layers", "all"], default=None,
                   help="stream at least the layers (or the layers and the output head) from disk, "
                        "whether or not they would fit")
    p.add_argument("--stream-io", choices=["pread", "mmap"], default="pread",
                   help="how streamed weights come in: pread copies each layer into one of two buffers "
                        "(default); mmap maps its pages in place and unmaps them after use (no copy)")
