"""How KV cache rows are stored: float32, float16 (round to nearest even,
overflow to inf), q8 (Q8_0 blocks of 32: float16 scale, 32 int8, quantized
as the integer path quantizes activations, ``ir.int_dot.quantize_q8_rows``)
or 4 and 2 bits (``ir.kv_lowbit``: records of 32, rotated or not), read
back as float32 (a rotated cache's values still rotated: ``kv_rotation``)."""
from __future__ import annotations

from typing import Any

import numpy as np

from .kv_lowbit import GROUP as LOWBIT_GROUP, decode as lowbit_decode, encode as lowbit_encode, of_array as lowbit_of
from .int_dot import quantize_q8_rows
from .quant import quant_type

#: values and bytes of one Q8_0 block of a q8 KV cache row
KV_BLOCK = quant_type("Q8_0").block
KV_Q8_BLOCK = quant_type("Q8_0").block_bytes


def kv_row_width(cache: np.ndarray) -> int:
    """Values per cache row. A q8 cache is its stored bytes (uint8
    [ctx, kv_dim / 32 * 34], from ``ir.interp.state_array``); a low-bit one
    its records [ctx, kv_dim / 32]."""
    if lowbit_of(cache) is not None:
        return cache.shape[1] * LOWBIT_GROUP
    if cache.dtype == np.uint8:
        return cache.shape[1] // KV_Q8_BLOCK * KV_BLOCK
    return cache.shape[1]


def kv_encode_q8(rows: np.ndarray) -> np.ndarray:
    """float32 [n, D] -> Q8_0 bytes [n, D / 32 * 34], quantized as
    ``quantize_q8_rows`` (d = float16(max|x| / 127), q = rint(x * 127 / max|x|))."""
    n, k = rows.shape
    d, q = quantize_q8_rows(rows)
    blk = np.empty((n, k // KV_BLOCK, KV_Q8_BLOCK), np.uint8)
    blk[..., :2] = d.astype("<f2").view(np.uint8).reshape(n, k // KV_BLOCK, 2)
    blk[..., 2:] = q.view(np.uint8)
    return blk.reshape(n, -1)


def kv_read(cache: np.ndarray, start: int, end: int) -> np.ndarray:
    """Rows start..end of a cache as float32 (f16 widened, q8 dequantized: d * q)."""
    return kv_decode(cache[start:end])


def kv_decode(part: np.ndarray) -> np.ndarray:
    """Stored cache rows (any selection of them) as float32."""
    if lowbit_of(part) is not None:
        return lowbit_decode(part)
    if part.dtype == np.uint8:
        blk = part.reshape(-1, KV_Q8_BLOCK)
        d = np.ascontiguousarray(blk[:, :2]).view("<f2").astype(np.float32)
        q = np.ascontiguousarray(blk[:, 2:]).view(np.int8).astype(np.float32)
        return (q * d).reshape(part.shape[0], -1)
    return part if part.dtype == np.float32 else part.astype(np.float32)


def kv_store(cache: np.ndarray, where: Any, x: np.ndarray) -> np.ndarray:
    """cache[where] = x's rows, rounded to the cache's storage: f16
    round-to-nearest-even (overflow to inf), q8 per block of 32
    (``kv_encode_q8``)."""
    rows = np.asarray(x, np.float32).reshape(-1, kv_row_width(cache))
    lb = lowbit_of(cache)
    with np.errstate(over="ignore"):  # f16 (or a q8 block's f16 scale) overflows to inf, as stored natively
        if lb is not None:
            cache[where] = lowbit_encode(rows, lb)
        else:
            cache[where] = kv_encode_q8(rows) if cache.dtype == np.uint8 else rows
    return cache


def kv_rotation(cache: np.ndarray) -> int:
    """The length of the Walsh-Hadamard rotation a cache's rows were stored
    under (its head_dim), 0 for none: attention rotates queries to match."""
    lb = lowbit_of(cache)
    return lb.rotate if lb is not None else 0
