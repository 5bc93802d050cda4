"""Quantizers that write GGUF blocks (for synthetic models and conversions).

Q8_0 .. Q5_1 come from the ``gguf`` package; it has no K-quant quantizer, so
Q4_K is written here: per 256-value super-block, eight sub-blocks of 32 get
an affine 4-bit code (scale and min), whose 6-bit scale/min codes are
themselves scaled by the super-block's fp16 ``d`` and ``dmin``.
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


def quantize(x: np.ndarray, qtype: str) -> np.ndarray:
    """Stored bytes of ``x`` in GGUF quant type ``qtype`` (F32 stays float)."""
    import gguf
    import gguf.quants

    if qtype == "F32":
        return np.asarray(x, np.float32)
    if qtype == "Q4_K":
        return quantize_q4_k(x)
    return gguf.quants.quantize(np.asarray(x, np.float32), gguf.GGMLQuantizationType[qtype])
