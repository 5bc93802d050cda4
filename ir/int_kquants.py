"""The integer path of ``qmatmul`` on K-quant weights (``act="q8k"``): the
numbers llama.cpp computes for Q2_K, Q3_K, Q4_K, Q5_K and Q6_K matmuls
(``ggml_vec_dot_q*_K_q8_K``), which the native kernel
(``compiler/codegen/k_matmul_int_kquants.py``) reproduces to float rounding.

Why a second activation format: a K-quant super-block has 8 (Q4_K, Q5_K)
or 16 (Q2_K, Q3_K, Q6_K) sub-blocks, each with its own integer scale, and
Q2_K / Q4_K / Q5_K subtract a per-sub-block minimum. Quantizing x once per
256 values (one float scale d_x, int8 quants) and keeping per-16 sums of
its quants (``bsums``) lets a whole super-block be one integer sum per term:

    out += d_w d_x * sum_s sc_s * (sum_l q_w q_x)          integer, exact
         - dmin_w d_x * sum_s m_s * bsum_s                 integer, exact

with bsum_s the sum of x's quants over sub-block s (two bsums for the
32-value sub-blocks of Q4_K / Q5_K). Q3_K and Q6_K have no minimum but
signed quants (Q3_K: -4..3, two low bits and a high bit from hmask, minus
4; Q6_K: -32..31, stored u = q + 32), and Q3_K's 6-bit scales are signed
(minus 32). The reference uses the signed values; the kernel unsigned ones
(q + 4, q + 32) with the offset folded into a -offset sc_s bsum16_s term.
The integer sums are exact, so kernel and reference differ only in the
float products and the order of the sum over super-blocks.

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

from .layouts_kquants import QK_K, _nibbles_by_subblock, scale_min_k4, scales_q3k

if TYPE_CHECKING:
    from .ops import WeightData

#: weight layouts the q8k integer path reads
KQ_INT_LAYOUTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
#: values per activation partial sum (``bsums``)
BSUM = 16
#: bytes per super-block
KQ_BLOCK_BYTES = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


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
    dmin: np.ndarray | None  # float32 [N, nb]; None for Q3_K, Q6_K
    sc: np.ndarray           # int32 [N, nb, S]: S = 8 sub-blocks of 32 (Q4_K, Q5_K), 16 of 16 (others)
    m: np.ndarray | None     # int32 [N, nb, S]; None for Q3_K, Q6_K
    q: np.ndarray            # int16 [N, nb, 256]: 0..3 (Q2_K), -4..3 (Q3_K), 0..15, 0..31, -32..31 (Q6_K)


def kquant_ints(w: "WeightData") -> KQuantInts:
    """The integer view of a K-quant weight, read from its bytes (layouts:
    ``ir/layouts_kquants.py``)."""
    name = w.type.layout
    if name not in KQ_INT_LAYOUTS:
        raise ValueError(f"no K-quant integers for layout {name}")
    n, k = int(w.type.shape[0]), int(w.type.shape[1])
    nb = k // QK_K
    blk = np.asarray(w.raw, np.uint8).reshape(n * nb, KQ_BLOCK_BYTES[name])

    def f16(at: int) -> np.ndarray:
        return np.ascontiguousarray(blk[:, at:at + 2]).view("<f2").astype(np.float32).reshape(n, nb)

    if name in ("Q2_K", "Q3_K"):
        return _low_bit_ints(name, blk, n, nb, f16)
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


def _two_bits(qs: np.ndarray) -> np.ndarray:
    """64 bytes of 2-bit fields per block -> uint8 [nblocks, 256] in value
    order (value 128h + 32i + l is bits 2i, 2i+1 of byte 32h + l)."""
    q = qs.reshape(-1, 2, 1, 32)
    return ((q >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3).reshape(-1, QK_K)


def _low_bit_ints(name: str, blk: np.ndarray, n: int, nb: int, f16) -> KQuantInts:
    """Q2_K (4-bit scale and min per 16 values, quants 0..3) and Q3_K
    (signed 6-bit scales, quants -4..3: the high bit of hmask set adds 4)."""
    if name == "Q2_K":
        q = _two_bits(blk[:, 16:80]).astype(np.int16)
        sc, mn = blk[:, 0:16] & 15, blk[:, 0:16] >> 4
        return KQuantInts(f16(80), f16(82), sc.astype(np.int32).reshape(n, nb, 16),
                          mn.astype(np.int32).reshape(n, nb, 16), q.reshape(n, nb, QK_K))
    hbit = (blk[:, None, 0:32] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1   # [n, run, l]
    q = _two_bits(blk[:, 32:96]).astype(np.int16) - 4 * (1 - hbit.reshape(-1, QK_K).astype(np.int16))
    sc = scales_q3k(blk[:, 96:108]).astype(np.int32)
    return KQuantInts(f16(108), None, sc.reshape(n, nb, 16), None, q.reshape(n, nb, QK_K))


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
    if wi.m is not None:   # sum_s m_s * bsum_s (bsum_s: x's quants summed over sub-block s), exact in float64
        sm = wi.m.shape[2]
        bsm = bs.reshape(bs.shape[0], nb, sm, 16 // sm).sum(axis=3).astype(np.float64)
    for r in range(0, n, 1024):  # row chunks bound the temporaries on large vocabularies
        rs = slice(r, r + 1024)
        weff = wi.q[rs].astype(np.float64) * np.repeat(wi.sc[rs], sub, axis=2)   # sc_s * q_w, integers
        for b in range(nb):
            s1 = qx64[:, b, :] @ weff[:, b, :].T                                   # exact integers
            out[:, rs] += s1 * (dx64[:, b, None] * wi.d[rs, b].astype(np.float64)[None, :])
        if wi.m is not None:
            s2 = np.einsum("mbs,nbs->mnb", bsm, wi.m[rs].astype(np.float64))
            out[:, rs] -= np.einsum("mnb,mb,nb->mn", s2, dx64, wi.dmin[rs].astype(np.float64))
    return out.astype(np.float32).reshape(xf.shape[:-1] + (n,))
