"""The integer path of ``qmatmul`` on K-quant weights (``act="q8k"``): the
numbers llama.cpp computes for Q4_K, Q5_K and Q6_K matmuls
(``ggml_vec_dot_q*_K_q8_K``), which the native kernel
(``compiler/codegen/k_matmul_int_kquants.py``) reproduces to float rounding.

Why a second activation format: a K-quant super-block has 8 (Q4_K, Q5_K)
or 16 (Q6_K) sub-blocks, each with its own integer scale, and Q4_K / Q5_K
subtract a per-sub-block minimum. Quantizing x once per 256 values (one
float scale d_x, int8 quants) and keeping per-16 sums of its quants
(``bsums``) lets a whole super-block be one integer sum per term:

    out += d_w d_x * sum_s sc_s * (sum_l q_w q_x)          integer, exact
         - dmin_w d_x * sum_s m_s * bsum32_s               integer, exact

(Q6_K has no minimum: its quants are stored as u - 32, and the reference
uses the signed value; the kernel folds the -32 into a -32 sc_s bsum16_s
term.) The integer sums are exact, so kernel and reference differ only in
the float products and the order of the sum over super-blocks.

Activation quantization (llama.cpp's ``quantize_row_q8_K``): per 256
values, amax = max|x|, iscale = 127 / amax, q = rint(x * iscale) (half to
even), d_x = 1 / iscale, all in float32, d_x kept as float32 (not float16
as Q8_0's). llama.cpp divides by the signed value of largest magnitude,
which flips the signs of both q and d_x when it is positive: the products
d_x q are the same numbers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .layouts_kquants import QK_K, _nibbles_by_subblock, scale_min_k4

if TYPE_CHECKING:
    from .ops import WeightData

#: weight layouts the q8k integer path reads
KQ_INT_LAYOUTS = ("Q4_K", "Q5_K", "Q6_K")
#: values per activation partial sum (``bsums``)
BSUM = 16
#: bytes per super-block
KQ_BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def quantize_q8k_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of x [M, K] (K a multiple of 256) as Q8_K blocks: d float32
    [M, K/256], q int8 [M, K/256, 256], bsums int32 [M, K/256, 16] (sums of
    16 consecutive quants). A block of zeros has d = 0 and q = 0."""
    x = np.asarray(x, np.float32)
    m, k = x.shape
    xb = x.reshape(m, k // QK_K, QK_K)
    amax = np.abs(xb).max(axis=2)
    with np.errstate(divide="ignore"):
        iscale = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
        d = np.where(amax > 0, np.float32(1) / iscale, np.float32(0)).astype(np.float32)
    q = np.rint(xb * iscale[:, :, None]).astype(np.int8)
    bsums = q.reshape(m, k // QK_K, QK_K // BSUM, BSUM).sum(axis=3, dtype=np.int32)
    return d, q, bsums


@dataclass
class KQuantInts:
    """A K-quant weight's super-blocks as integers and float factors:
    value = d * sc[s] * q - dmin * m[s] for the value's sub-block s."""

    d: np.ndarray            # float32 [N, nb]
    dmin: np.ndarray | None  # float32 [N, nb]; None for Q6_K
    sc: np.ndarray           # int32 [N, nb, S]: S = 8 sub-blocks of 32 (Q4_K, Q5_K), 16 of 16 (Q6_K)
    m: np.ndarray | None     # int32 [N, nb, 8]; None for Q6_K
    q: np.ndarray            # int16 [N, nb, 256]: 0..15, 0..31, or -32..31 (Q6_K)


def kquant_ints(w: "WeightData") -> KQuantInts:
    """The integer view of a Q4_K / Q5_K / Q6_K weight, read from its bytes
    (layouts: ``ir/layouts_kquants.py``)."""
    name = w.type.layout
    if name not in KQ_INT_LAYOUTS:
        raise ValueError(f"no K-quant integers for layout {name}")
    n, k = int(w.type.shape[0]), int(w.type.shape[1])
    nb = k // QK_K
    blk = np.asarray(w.raw, np.uint8).reshape(n * nb, KQ_BLOCK_BYTES[name])

    def f16(at: int) -> np.ndarray:
        return np.ascontiguousarray(blk[:, at:at + 2]).view("<f2").astype(np.float32).reshape(n, nb)

    if name == "Q6_K":
        ql = blk[:, 0:128].reshape(-1, 2, 2, 32)
        qh = blk[:, 128:192].reshape(-1, 2, 1, 32)
        lo = np.concatenate([ql & 15, ql >> 4], axis=2)
        hi = (qh >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3
        q = (lo | (hi << 4)).astype(np.int16) - 32
        sc = blk[:, 192:208].view(np.int8).astype(np.int32)
        return KQuantInts(f16(208), None, sc.reshape(n, nb, 16), None, q.reshape(n, nb, QK_K))
    sc, mn = scale_min_k4(blk[:, 4:16])
    if name == "Q4_K":
        q = _nibbles_by_subblock(blk[:, 16:144]).astype(np.int16)
    else:
        bit = (blk[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
        q = (_nibbles_by_subblock(blk[:, 48:176]) | (bit << 4)).astype(np.int16)
    return KQuantInts(f16(0), f16(2), sc.astype(np.int32).reshape(n, nb, 8),
                      mn.astype(np.int32).reshape(n, nb, 8), q.reshape(n, nb, QK_K))


def qmatmul_q8k_ref(x: np.ndarray, w: "WeightData") -> np.ndarray:
    """x [..., K] @ w.T on the integer path (see the module docstring): the
    integer sums exact, the float products and the sum over super-blocks in
    float64, rounded once to float32."""
    xf = np.asarray(x, np.float32)
    k = xf.shape[-1]
    dx, qx, bs = quantize_q8k_rows(xf.reshape(-1, k))
    wi = kquant_ints(w)
    n, nb = wi.d.shape
    sub = QK_K // wi.sc.shape[2]
    qx64, dx64 = qx.astype(np.float64), dx.astype(np.float64)
    out = np.zeros((qx.shape[0], n), np.float64)
    if wi.m is not None:   # sum_s m_s * bsum32_s, exact in float64
        bs32 = bs.reshape(bs.shape[0], nb, 8, 2).sum(axis=3).astype(np.float64)
    for r in range(0, n, 1024):  # row chunks bound the temporaries on large vocabularies
        rs = slice(r, r + 1024)
        weff = wi.q[rs].astype(np.float64) * np.repeat(wi.sc[rs], sub, axis=2)   # sc_s * q_w, integers
        for b in range(nb):
            s1 = qx64[:, b, :] @ weff[:, b, :].T                                   # exact integers
            out[:, rs] += s1 * (dx64[:, b, None] * wi.d[rs, b].astype(np.float64)[None, :])
        if wi.m is not None:
            s2 = np.einsum("mbs,nbs->mnb", bs32, wi.m[rs].astype(np.float64))
            out[:, rs] -= np.einsum("mnb,mb,nb->mn", s2, dx64, wi.dmin[rs].astype(np.float64))
    return out.astype(np.float32).reshape(xf.shape[:-1] + (n,))
