"""QSF's block types on the integer path of ``qmatmul`` (``act="q8"``): their
blocks as integer quants with a scale and an offset, in the form
``ir.ops.qmatmul_ref`` multiplies with Q8_0-style activation blocks.

A QSF block has 64 values (``ir/layouts_qsf.py``), the q8 activation block
32. So each weight block is two 32-value blocks of the integer path that
share the weight block's scale d (and offset); the sum over blocks then is
the same formula as for GGUF's Q8_0 .. Q5_1:

    out = sum_b d_w * d_x * (sum q_w q_x) + m_w * d_x * (sum q_x)

with value = d_w * q_w + m_w per layout:

    layout        q_w                      d_w    m_w
    QSF_Q8        int8 q                   d      (none)
    QSF_Q4        nibble q, 0..15          d      -z * d
    QSF_Q2        crumb q, 0..3            d      m
    QSF_Q2S       crumb q, 0..3            d      -1.5 * d
    QSF_TERNARY   t in {-1, 0, +1}         d      (none)

Every m_w is exact in float32: d, z and m are float16, and a product of two
float16 values (11-bit significands) fits float32's 24 bits (Q2S: 1.5 has
two). So d_w q_w + m_w equals the layout's float dequantization up to that
one float32 rounding of (q - z) * d, (q - 1.5) * d, which the integer
path's float64 does not make: the values are the same reals.
"""
from __future__ import annotations

import numpy as np

from .layouts_qsf import QK, _bits64, _crumbs, _f16_at, _nibbles

#: the QSF layouts with integer quants, and those with an offset m_w
QSF_INT_LAYOUTS = ("QSF_Q8", "QSF_Q4", "QSF_Q2", "QSF_Q2S", "QSF_TERNARY")
QSF_OFFSET_LAYOUTS = ("QSF_Q4", "QSF_Q2", "QSF_Q2S")
#: bytes per 64-value block
QSF_BLOCK_BYTES = {"QSF_Q8": 66, "QSF_Q4": 36, "QSF_Q2": 20, "QSF_Q2S": 18, "QSF_TERNARY": 18}
#: values per activation block (``ir.ops.QK8``)
_QA = 32


def qsf_int_blocks(name: str, raw: np.ndarray, n: int, k: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A QSF weight [n, k] (its stored bytes) as 32-value integer blocks:
    (d float32 [n, k/32], q int8 [n, k/32, 32], m float32 [n, k/32] or None),
    value = d * q (+ m); each 64-value block's d and m appear twice."""
    bb = QSF_BLOCK_BYTES[name]
    blk = np.asarray(raw, np.uint8).reshape(-1, bb)
    d = _f16_at(blk, 0)                                            # [blocks, 1]
    m = None
    if name == "QSF_Q8":
        q = np.ascontiguousarray(blk[:, 2:2 + QK]).view(np.int8)
    elif name == "QSF_Q4":
        q, m = _nibbles(blk[:, 4:4 + QK // 2]), -(_f16_at(blk, 2) * d)
    elif name == "QSF_Q2":
        q, m = _crumbs(blk[:, 4:4 + QK // 4]), _f16_at(blk, 2)
    elif name == "QSF_Q2S":
        q, m = _crumbs(blk[:, 2:2 + QK // 4]), -(np.float32(1.5) * d)
    else:   # ternary: zero wins over sign
        t = np.where(_bits64(blk, 2), np.int8(-1), np.int8(1))
        q = np.where(_bits64(blk, 10), np.int8(0), t)
    nb = k // _QA

    def per_block(v: np.ndarray) -> np.ndarray:
        return np.repeat(v[:, 0], 2).astype(np.float32).reshape(n, nb)

    return (per_block(d), q.astype(np.int8).reshape(n, nb, _QA),
            None if m is None else per_block(m))
