"""GGUF's simple block types: BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1.

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

Where each field sits, the zero point (8, 16) and whether a block has an
offset are the types' rows in ``ir.quant.table``. The numpy dequantizers
below are the references for the fused kernels; they compute in float32 in
the same order as ggml (``d * q``, then ``+ m``), so they agree with it bit
for bit.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .base import BlockLayout


def f16_at(blocks: np.ndarray, off: int) -> np.ndarray:
    """The float16 at byte ``off`` of every block, as float32 [nblocks, 1]."""
    lo = blocks[:, off].astype(np.uint16)
    hi = blocks[:, off + 1].astype(np.uint16)
    return (lo | (hi << np.uint16(8))).view(np.float16).astype(np.float32)[:, None]


def nibbles(blocks: np.ndarray, off: int, n: int = 32) -> np.ndarray:
    """The n 4-bit quants stored in the n/2 bytes at ``off`` (low nibbles
    first): uint8 [nblocks, n]."""
    qs = blocks[:, off:off + n // 2]
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=1)


def high_bits(blocks: np.ndarray, off: int) -> np.ndarray:
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
        at = self.at("qs")
        q = np.ascontiguousarray(blocks[:, at:at + self.block]).view(np.int8)
        return f16_at(blocks, self.at("d")) * q.astype(np.float32)

    def int_blocks(self, raw: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(d float32 [n, k/32], q int8 [n, k/32, 32], None): value = d * q."""
        blk = np.asarray(raw, np.uint8).reshape(-1, self.block_bytes)
        at = self.at("qs")
        q = np.ascontiguousarray(blk[:, at:at + self.block]).view(np.int8)
        nb = k // self.block
        return f16_at(blk, self.at("d")).reshape(n, nb), q.reshape(n, nb, self.block), None


@dataclass(frozen=True)
class NibbleLayout(BlockLayout):
    """Q4_0, Q4_1, Q5_0, Q5_1: nibbles (and for 5 bits a word of fifth bits),
    stored unsigned; the signed quant is the stored one minus the type's
    zero point; value = d * q, or d * q + m with a block offset."""

    def quants(self, blocks: np.ndarray) -> np.ndarray:
        """The signed quants (stored minus the zero point): int16 [nblocks, 32]."""
        q = nibbles(blocks, self.at("qs")).astype(np.int16)
        if self.qt.has("qh"):
            q = q | (high_bits(blocks, self.at("qh")).astype(np.int16) << 4)
        return q - self.qt.zero

    def dequant_blocks(self, blocks: np.ndarray) -> np.ndarray:
        q = self.quants(blocks).astype(np.float32)
        if self.qt.offset:
            return f16_at(blocks, self.at("d")) * q + f16_at(blocks, self.at("m"))
        return f16_at(blocks, self.at("d")) * q

    def int_blocks(self, raw: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(d float32 [n, k/32], q int8 [n, k/32, 32], m float32 [n, k/32] or
        None): value = d * q (+ m), read from the stored bytes."""
        blk = np.asarray(raw, np.uint8).reshape(-1, self.block_bytes)
        nb = k // self.block
        m = f16_at(blk, self.at("m")).reshape(n, nb) if self.qt.offset else None
        q = self.quants(blk).astype(np.int8).reshape(n, nb, self.block)
        return f16_at(blk, self.at("d")).reshape(n, nb), q, m
