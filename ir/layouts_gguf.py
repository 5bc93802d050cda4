"""GGUF's simple block quant types: BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1.

Each 32-value block starts with its float16 scale ``d`` (and, for the ``_1``
types, a float16 offset ``m``); then, for the 5-bit types, a little-endian
uint32 whose bit ``j`` is the fifth bit of value ``j``; then the quants.
4-bit quants come two to a byte: the low nibbles of the 16 bytes are values
0..15, the high nibbles values 16..31 (not interleaved pairs).

    Q8_0  [d f16][32 x int8]                 v = q * d
    Q4_0  [d f16][16 x nibble pairs]         v = (q - 8) * d
    Q4_1  [d f16][m f16][16 x pairs]         v = q * d + m
    Q5_0  [d f16][qh u32][16 x pairs]        v = ((q | h << 4) - 16) * d
    Q5_1  [d f16][m f16][qh u32][16 x pairs] v = (q | h << 4) * d + m
    BF16  the upper half of a float32, a "block" of one value

The numpy dequantizers below are the references for the fused kernels in
``compiler/codegen/k_matmul_gguf.py``. They compute in float32 in the same
order as ggml (``d * q``, then ``+ m``), so they agree with it bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .layouts import BlockLayout, register_layout

QK = 32  # values per block of the Q types


def _f16_at(blocks: np.ndarray, off: int) -> np.ndarray:
    """The float16 at byte ``off`` of every block, as float32 [nblocks, 1]."""
    lo = blocks[:, off].astype(np.uint16)
    hi = blocks[:, off + 1].astype(np.uint16)
    return (lo | (hi << np.uint16(8))).view(np.float16).astype(np.float32)[:, None]


def _nibbles(blocks: np.ndarray, off: int) -> np.ndarray:
    """The 32 4-bit quants stored in the 16 bytes at ``off``: uint8 [nblocks, 32]."""
    qs = blocks[:, off:off + QK // 2]
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=1)


def _high_bits(blocks: np.ndarray, off: int) -> np.ndarray:
    """Bit j of the little-endian uint32 at ``off``, for j = 0..31: uint8 [nblocks, 32]."""
    return np.unpackbits(np.ascontiguousarray(blocks[:, off:off + 4]), axis=1, bitorder="little")


@dataclass(frozen=True)
class BF16Layout(BlockLayout):
    def dequant_blocks(self, blocks: np.ndarray) -> np.ndarray:
        bits = blocks[:, 0].astype(np.uint32) | (blocks[:, 1].astype(np.uint32) << np.uint32(8))
        return (bits << np.uint32(16)).view(np.float32)[:, None]


@dataclass(frozen=True)
class Q8_0Layout(BlockLayout):
    def dequant_blocks(self, blocks: np.ndarray) -> np.ndarray:
        q = np.ascontiguousarray(blocks[:, 2:2 + QK]).view(np.int8)
        return _f16_at(blocks, 0) * q.astype(np.float32)


@dataclass(frozen=True)
class Q4_0Layout(BlockLayout):
    def dequant_blocks(self, blocks: np.ndarray) -> np.ndarray:
        q = _nibbles(blocks, 2).astype(np.int8) - np.int8(8)
        return _f16_at(blocks, 0) * q.astype(np.float32)


@dataclass(frozen=True)
class Q4_1Layout(BlockLayout):
    def dequant_blocks(self, blocks: np.ndarray) -> np.ndarray:
        q = _nibbles(blocks, 4).astype(np.float32)
        return _f16_at(blocks, 0) * q + _f16_at(blocks, 2)


@dataclass(frozen=True)
class Q5_0Layout(BlockLayout):
    def dequant_blocks(self, blocks: np.ndarray) -> np.ndarray:
        q = (_nibbles(blocks, 6) | (_high_bits(blocks, 2) << np.uint8(4))).astype(np.int8) - np.int8(16)
        return _f16_at(blocks, 0) * q.astype(np.float32)


@dataclass(frozen=True)
class Q5_1Layout(BlockLayout):
    def dequant_blocks(self, blocks: np.ndarray) -> np.ndarray:
        q = (_nibbles(blocks, 8) | (_high_bits(blocks, 4) << np.uint8(4))).astype(np.float32)
        return _f16_at(blocks, 0) * q + _f16_at(blocks, 2)


def _block(cls: type, name: str, block: int, block_bytes: int) -> BlockLayout:
    return register_layout(cls(name=name, itemsize=block_bytes, np_dtype="u1", block=block,
                               block_bytes=block_bytes))


BF16 = _block(BF16Layout, "BF16", 1, 2)
Q8_0 = _block(Q8_0Layout, "Q8_0", QK, 2 + QK)
Q4_0 = _block(Q4_0Layout, "Q4_0", QK, 2 + QK // 2)
Q4_1 = _block(Q4_1Layout, "Q4_1", QK, 4 + QK // 2)
Q5_0 = _block(Q5_0Layout, "Q5_0", QK, 6 + QK // 2)
Q5_1 = _block(Q5_1Layout, "Q5_1", QK, 8 + QK // 2)
