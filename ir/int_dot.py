"""The integer path's numbers (``act``, set by ``passes/int_dot``): the
activations quantized per block, integer dot products with the weight's
integer quants, float scales applied to the exact integer sums: what
llama.cpp computes (``ggml_vec_dot_q*_q8_0``, ``_q8_1``, ``_q*_K_q8_K``) and
the native kernels reproduce to float rounding.

Two activation formats; a weight type's row in ``ir.quant.table`` says which
its integer path takes (``act``):

* ``q8``, blocks of 32 (llama.cpp's x86 ``quantize_row_q8_0``: amax = max|x|,
  d = float16(amax / 127), q = rint(x * 127 / amax)), for the 32-value GGUF
  types and QSF's 64-value blocks (two 32-value blocks sharing d and the
  offset: the layouts' ``int_blocks``):

      out = sum_b d_w d_x (sum q_w q_x) + m_w d_x (sum q_x)

  the second term only for types with an offset (value = d q + m).
* ``q8k``, blocks of 256 (``quantize_row_q8_K``: iscale = 127 / amax,
  q = rint(x * iscale), d_x = 1 / iscale kept as float32), for the K-quants,
  whose super-blocks have 8 or 16 sub-blocks with integer scales sc_s and,
  for Q2_K / Q4_K / Q5_K, minimums m_s (the layouts' ``int_superblocks``).
  With bsum_s the sum of x's quants over sub-block s:

      out += d_w d_x * sum_s sc_s (sum_l q_w q_x) - dmin_w d_x * sum_s m_s bsum_s

  llama.cpp divides by the signed value of largest magnitude, which flips
  the signs of both q and d_x when it is positive: the products are the same.

The integer sums are exact; the products and the sum over blocks are done
in float64 here and rounded once to float32.
"""
from __future__ import annotations

import numpy as np

from .quant import ACT_BLOCK, quant_type, types_with
from .weight_data import WeightData

#: values per block of the q8 activation format, and per partial sum (``bsums``) of q8k
QK8 = ACT_BLOCK["q8"]
QK_K = ACT_BLOCK["q8k"]
BSUM = 16
#: activation format -> the weight types it multiplies
ACT_LAYOUTS = {act: types_with(act=act) for act in ACT_BLOCK}


def int_act(layout: str | None) -> str | None:
    """The integer path's activation format for a weight layout ("q8" for
    the 32-value blocks and QSF's, "q8k" for the K-quants), None if none."""
    try:
        return quant_type(layout).act if layout else None
    except KeyError:
        return None


def quantize_q8_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of x [M, K] as llama.cpp's x86 ``quantize_row_q8_0``: per block of
    32, amax = max|x|, d = float16(amax / 127), q = rint(x * (127 / amax))
    (round half to even; 0 where amax is 0), all in float32. Returns d as
    float32 [M, K/32] (the float16 value) and q as int8 [M, K/32, 32]."""
    x = np.asarray(x, np.float32)
    m, k = x.shape
    xb = x.reshape(m, k // QK8, QK8)
    amax = np.abs(xb).max(axis=2)
    d = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv[:, :, None]).astype(np.int8)
    return d, q


def int_blocks(w: WeightData) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A q8-path weight's blocks as (d, q, m), read from its stored bytes:
    the scales d (float32 [N, K/32]), the integer quants q (int8
    [N, K/32, 32]) with value = d * q, or = d * q + m for the types with an
    offset, whose m (float32 [N, K/32]) comes third (else None)."""
    name = w.type.layout
    qt = quant_type(name)
    if qt.act != "q8":
        raise ValueError(f"no q8 integer quants for layout {name}")
    return qt.layout.int_blocks(w.raw, int(w.type.shape[0]), int(w.type.shape[1]))


def qmatmul_q8_ref(x: np.ndarray, w: WeightData) -> np.ndarray:
    """x [..., K] @ w.T on the q8 integer path (module docstring)."""
    xf = np.asarray(x, np.float32)
    k = xf.shape[-1]
    dx, qx = quantize_q8_rows(xf.reshape(-1, k))                    # [M, nb], [M, nb, 32]
    dw, qw, mw = int_blocks(w)                                      # [N, nb], [N, nb, 32], [N, nb] | None
    n = qw.shape[0]
    out = np.empty((qx.shape[0], n), np.float64)
    qxf, dx64 = qx.astype(np.float32), dx.astype(np.float64)
    sxd = dx64 * qx.sum(axis=2, dtype=np.int64)                     # [M, nb]: d_x * sum(q_x), exact
    for r in range(0, n, 4096):  # row chunks bound the temporaries on large vocabularies
        # block sums are integers below 2^24 (32 x 127 x 128): exact in float32
        isum = np.einsum("nbj,mbj->mnb", qw[r:r + 4096].astype(np.float32), qxf)
        out[:, r:r + 4096] = np.einsum("mnb,nb,mb->mn", isum.astype(np.float64),
                                       dw[r:r + 4096].astype(np.float64), dx64)
        if mw is not None:
            out[:, r:r + 4096] += sxd @ mw[r:r + 4096].astype(np.float64).T
    return out.astype(np.float32).reshape(xf.shape[:-1] + (n,))


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


def kquant_ints(w: WeightData):
    """The integer view of a K-quant weight (``KQuantInts``), read from its bytes."""
    qt = quant_type(w.type.layout)
    if qt.act != "q8k":
        raise ValueError(f"no K-quant integers for layout {w.type.layout}")
    return qt.layout.int_superblocks(w.raw, int(w.type.shape[0]), int(w.type.shape[1]))


def qmatmul_q8k_ref(x: np.ndarray, w: WeightData) -> np.ndarray:
    """x [..., K] @ w.T on the q8k integer path (module docstring): the
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


def qmatmul_int_ref(x: np.ndarray, w: WeightData, act: str) -> np.ndarray:
    """x @ w.T on the integer path of activation format ``act``."""
    return qmatmul_q8k_ref(x, w) if act == "q8k" else qmatmul_q8_ref(x, w)
