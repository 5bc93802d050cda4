"""Quantizers that write GGUF blocks (for synthetic models and conversions).

Q8_0 .. Q5_1 come from the ``gguf`` package; it has no K-quant quantizer, so
Q4_K is written here: per 256-value super-block, eight sub-blocks of 32 get
an affine 4-bit code (scale and min), whose 6-bit scale/min codes are
themselves scaled by the super-block's fp16 ``d`` and ``dmin``. Q2_K (an
affine 2-bit code per 16 values, 4-bit scale and min codes) and Q3_K (a
symmetric 3-bit code per 16 values, signed 6-bit scale codes) likewise,
for synthetic models of those types. These are plain min/max quantizers,
not llama.cpp's error-minimising searches: good enough for models whose
numbers only need to be the same through every path. IQ4_NL and IQ4_XS,
which the ``gguf`` package reads but does not write, come from their numpy
layouts' quantizers (``ir/quant/lut.py``); MXFP4 from ``gguf``.
"""
from __future__ import annotations

import numpy as np


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """float32 [..., K] (K % 256 == 0) -> uint8 [..., K/256 * 144]."""
    x = np.asarray(x, np.float32)
    lead, k = x.shape[:-1], x.shape[-1]
    if k % 256:
        raise ValueError(f"Q4_K needs rows of a multiple of 256 values, got {k}")
    sb = x.reshape(-1, 8, 32)                       # super-blocks x sub-blocks x values
    lo = np.minimum(sb.min(axis=2), 0.0)            # the code's zero must be reachable
    hi = sb.max(axis=2)
    scale = (hi - lo) / 15.0
    mins = -lo
    d = (scale.max(axis=1) / 63.0).astype(np.float16)
    dmin = (mins.max(axis=1) / 63.0).astype(np.float16)
    df, dminf = d.astype(np.float32), dmin.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df[:, None] > 0, np.rint(scale / df[:, None]), 0).clip(0, 63).astype(np.uint8)
        mn = np.where(dminf[:, None] > 0, np.rint(mins / dminf[:, None]), 0).clip(0, 63).astype(np.uint8)
        step = df[:, None] * sc                     # effective sub-block scale
        off = dminf[:, None] * mn
        q = np.where(step[:, :, None] > 0, np.rint((sb + off[:, :, None]) / step[:, :, None]), 0)
    q = q.clip(0, 15).astype(np.uint8)
    nb = sb.shape[0]
    out = np.zeros((nb, 144), np.uint8)
    out[:, 0:2] = d.view(np.uint8).reshape(nb, 2)
    out[:, 2:4] = dmin.view(np.uint8).reshape(nb, 2)
    packed = np.zeros((nb, 12), np.uint8)
    packed[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = (mn[:, 0:4] & 63) | ((mn[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:8] & 0xF) | ((mn[:, 4:8] & 0xF) << 4)
    out[:, 4:16] = packed
    # 32 bytes per pair of sub-blocks: low nibbles the first, high the second
    pairs = q.reshape(nb, 4, 2, 32)
    out[:, 16:] = (pairs[:, :, 0, :] | (pairs[:, :, 1, :] << 4)).reshape(nb, 128)
    return out.reshape(lead + (k // 256 * 144,))


def _super_blocks(x: np.ndarray, name: str) -> np.ndarray:
    """float32 [..., K] -> [super-blocks, 16, 16] (sub-blocks of 16 values)."""
    x = np.asarray(x, np.float32)
    if x.shape[-1] % 256:
        raise ValueError(f"{name} needs rows of a multiple of 256 values, got {x.shape[-1]}")
    return x.reshape(-1, 16, 16)


def _codes(v: np.ndarray, step: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """rint(v / step) clipped to [lo, hi]; 0 where step is 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(step != 0, np.rint(v / step), 0).clip(lo, hi)


def _pack_two_bits(q: np.ndarray) -> np.ndarray:
    """[n, 256] values 0..3 -> [n, 64] bytes: value 128h + 32i + l in bits 2i, 2i+1 of byte 32h + l."""
    q = q.astype(np.uint8).reshape(-1, 2, 4, 32)
    return (q[:, :, 0] | q[:, :, 1] << 2 | q[:, :, 2] << 4 | q[:, :, 3] << 6).reshape(-1, 64)


def quantize_q2_k(x: np.ndarray) -> np.ndarray:
    """float32 [..., K] (K % 256 == 0) -> uint8 [..., K/256 * 84]: per 16
    values q in 0..3 with value = d*sc*q - dmin*m (sc, m: 4-bit codes)."""
    sb = _super_blocks(x, "Q2_K")
    lo = np.minimum(sb.min(axis=2), 0.0)            # the code's zero must be reachable
    scale, mins = (sb.max(axis=2) - lo) / 3.0, -lo
    d = (scale.max(axis=1) / 15.0).astype(np.float16)
    dmin = (mins.max(axis=1) / 15.0).astype(np.float16)
    sc = _codes(scale, d.astype(np.float32)[:, None], 0, 15)
    mn = _codes(mins, dmin.astype(np.float32)[:, None], 0, 15)
    step = d.astype(np.float32)[:, None] * sc
    off = dmin.astype(np.float32)[:, None] * mn
    q = _codes(sb + off[:, :, None], step[:, :, None], 0, 3)
    nb = sb.shape[0]
    out = np.zeros((nb, 84), np.uint8)
    out[:, 0:16] = sc.astype(np.uint8) | (mn.astype(np.uint8) << 4)
    out[:, 16:80] = _pack_two_bits(q.reshape(nb, 256))
    out[:, 80:82] = d.view(np.uint8).reshape(nb, 2)
    out[:, 82:84] = dmin.view(np.uint8).reshape(nb, 2)
    return out.reshape(np.shape(x)[:-1] + (np.shape(x)[-1] // 256 * 84,))


def quantize_q3_k(x: np.ndarray) -> np.ndarray:
    """float32 [..., K] (K % 256 == 0) -> uint8 [..., K/256 * 110]: per 16
    values q in -4..3 with value = d*sc*q (sc: a signed 6-bit code). As
    llama.cpp does, a sub-block's value of largest magnitude maps to -4
    (its scale takes that value's sign), so the full range -4..3 is used."""
    sb = _super_blocks(x, "Q3_K")
    nb = sb.shape[0]
    at = np.abs(sb).argmax(axis=2)
    scale = -np.take_along_axis(sb, at[:, :, None], axis=2)[:, :, 0] / 4.0      # signed
    top = np.take_along_axis(scale, np.abs(scale).argmax(axis=1)[:, None], axis=1)[:, 0]
    d = (-top / 32.0).astype(np.float16)
    sc = _codes(scale, d.astype(np.float32)[:, None], -32, 31)
    q = _codes(sb, (d.astype(np.float32)[:, None] * sc)[:, :, None], -4, 3).reshape(nb, 256) + 4
    u = (sc + 32).astype(np.uint8)                   # 6-bit codes: low nibbles, then 2-bit tops
    out = np.zeros((nb, 110), np.uint8)
    bit = (q.astype(np.uint8) >> 2).reshape(nb, 8, 32)                           # run r, byte l
    out[:, 0:32] = (bit << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)
    out[:, 32:96] = _pack_two_bits(q.astype(np.uint8) & 3)
    out[:, 96:104] = (u[:, 0:8] & 15) | ((u[:, 8:16] & 15) << 4)
    tops = (u >> 4).reshape(nb, 4, 4)                # [k, t]: code 4k + t
    out[:, 104:108] = (tops << (2 * np.arange(4, dtype=np.uint8))[None, :, None]).sum(axis=1, dtype=np.uint8)
    out[:, 108:110] = d.view(np.uint8).reshape(nb, 2)
    return out.reshape(np.shape(x)[:-1] + (np.shape(x)[-1] // 256 * 110,))


#: GGUF types written here rather than by the ``gguf`` package
K_QUANTIZERS = {"Q2_K": quantize_q2_k, "Q3_K": quantize_q3_k, "Q4_K": quantize_q4_k}
#: GGUF types the ``gguf`` package cannot quantize, written by their numpy
#: layout's ``quantize`` (``ir/quant/lut.py``)
LAYOUT_QUANTIZED = ("IQ4_NL", "IQ4_XS")


def quantizable(qtype: str) -> bool:
    """Whether ``quantize`` can write ``qtype`` (Q5_K and Q6_K it cannot:
    neither lmc nor the ``gguf`` package has their quantizer)."""
    import gguf
    import gguf.quants

    if qtype == "F32" or qtype in K_QUANTIZERS or qtype in LAYOUT_QUANTIZED:
        return True
    if qtype not in gguf.GGMLQuantizationType.__members__:
        return False
    try:
        gguf.quants.quantize(np.zeros((1, 256), np.float32), gguf.GGMLQuantizationType[qtype])
    except NotImplementedError:
        return False
    return True


def quantize(x: np.ndarray, qtype: str) -> np.ndarray:
    """Stored bytes of ``x`` in GGUF quant type ``qtype`` (F32 stays float)."""
    import gguf
    import gguf.quants

    if qtype == "F32":
        return np.asarray(x, np.float32)
    if qtype in K_QUANTIZERS:
        return K_QUANTIZERS[qtype](x)
    if qtype in LAYOUT_QUANTIZED:
        from ir.quant import get_layout

        x = np.asarray(x, np.float32)
        lay = get_layout(qtype)
        return lay.quantize(x.reshape(-1, x.shape[-1])).reshape(x.shape[:-1] + (x.shape[-1] // lay.block
                                                                                 * lay.block_bytes,))
    return gguf.quants.quantize(np.asarray(x, np.float32), gguf.GGMLQuantizationType[qtype])
