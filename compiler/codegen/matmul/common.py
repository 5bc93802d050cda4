"""What the matmul kernels share: tiling parameters a kernel attribute may
override (``lmc kernel``), where a matmul's rows go, the decode step's
prefetch distance, and splitting a static tail into vector widths."""
from __future__ import annotations

import llvmlite.ir as ir

from ..emit import KernelBuilder
from ..kernels import KernelSig

#: bytes ahead of the weights in use that a decode tile prefetches (see
#: float_tiles._prefetch_rows; measured with ``lmc kernel --prefetch``: 2048 best of
#: 0/512/1024/2048/4096 for Q4_0, Q5_0 and Q8_0 on 896..151936-row matrices)
PREFETCH_BYTES = 2048


def pow2_pieces(n: int, vw: int) -> list[int]:
    """Split ``n`` columns into vector widths: whole ``vw`` vectors, then
    narrower powers of two (8, 4, 2, 1)."""
    out = [vw] * (n // vw)
    n %= vw
    w = vw // 2
    while n:
        if n >= w:
            out.append(w)
            n -= w
        w //= 2
    return out


def as_int(d) -> int:
    if not isinstance(d, int):
        raise NotImplementedError(f"weight dims must be static, got {d!r}")
    return d


def tuned(kb: KernelBuilder, attrs: dict, name: str, default: int) -> int:
    """A tiling parameter: the kernel attribute ``name`` if set (``lmc kernel``
    sets them; graphs do not), else ``default``; recorded in ``kb.tuning``."""
    v = int(attrs.get(name, default))
    if v < 1:
        raise NotImplementedError(f"{name} must be >= 1, got {v}")
    kb.tuning[name] = v
    return v


def out_rows(kb: KernelBuilder, sig: KernelSig) -> tuple[ir.Value, int]:
    """Where a matmul's rows go and the output's row stride. ``qmatmul_rows``
    (a row block of a weight split for streaming) writes its rows into the
    full-width result; the lowering passes the output pointer at its first
    row (``row0``), so the kernel knows only the stride ``n_total``. Every
    other matmul owns its output."""
    out = kb.out_f32()
    n = as_int(sig.in_types[1].shape[0])
    if sig.op != "qmatmul_rows":
        return out, n
    return out, int(sig.attr["n_total"])
