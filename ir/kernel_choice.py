"""Kernel choices: how a node's op is run, apart from what it computes.

``passes/int_dot`` (and the verify graph's builder) decides that the
matmuls of a batch of decode rows compute each row with the decode step's
arithmetic, up to ``decode_rows`` rows sharing each unpacked weight block,
and that a prompt chunk's integer matmuls run as a GEMM over ``gemm`` token
rows at a time. A row's numbers are the op's either way (no row depends on
the rows beside it), so these live in ``Node.kernel``, not in its
attributes: shape rules and numpy references never see them. The code
generator does (``KernelSig`` specialises a kernel on them as on the
attributes), the printer shows them with the attributes, and the
interpreter runs a ``decode_rows`` node a row at a time, as its kernel does.
"""
from __future__ import annotations

from typing import Any

#: the kernel choices a node may carry, and what each is
CHOICES = {"decode_rows": "rows computed with the decode step's arithmetic, this many sharing each weight block",
           "gemm": "a prompt chunk's integer matmul as a GEMM, this many token rows quantized at once"}
#: the ops that take them
MATMUL_OPS = ("matmul", "qmatmul", "qmatmul_rows", "qmatmul_add")


def check(op: str, attrs: dict[str, Any], kernel: dict[str, Any]) -> None:
    """ValueError unless ``kernel`` is a valid record for an ``op`` node with ``attrs``."""
    for name, v in kernel.items():
        if name not in CHOICES:
            raise ValueError(f"unknown kernel choice {name}={v!r} (known: {', '.join(CHOICES)})")
        if op not in MATMUL_OPS:
            raise ValueError(f"kernel choice {name} is for matmuls, not {op}")
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}={v!r}: must be a positive row count")
    if "gemm" in kernel and (attrs.get("act") is None or "decode_rows" in kernel):
        raise ValueError(f"gemm={kernel['gemm']!r}: only on the integer path (act), without decode_rows")
