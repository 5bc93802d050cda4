"""GGUF's K-quant layouts: super-blocks of 256 values with per-sub-block
scales (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), as llama.cpp stores them.

Byte layouts of one super-block (all little-endian, f16 = IEEE half):

* Q4_K, 144 bytes: f16 d, f16 dmin, 12 bytes of eight packed 6-bit
  (scale, min) pairs, 128 bytes of nibbles. Value ``64j + 32h + l`` (chunk
  j < 4, half h < 2, l < 32) is nibble h of byte ``32j + l`` and belongs to
  sub-block ``2j + h``: ``d*sc[s]*q - dmin*m[s]``.
* Q5_K, 176 bytes: as Q4_K with 32 bytes of fifth bits between the scales
  and the nibbles: value ``32s + l`` gains bit ``s`` of ``qh[l]`` as its bit 4.
* Q6_K, 210 bytes: 128 bytes of low nibbles, 64 bytes of 2-bit high parts,
  16 int8 scales (one per 16 values), f16 d. In half h (128 values), value
  ``128h + 32i + l`` takes the low (i < 2) or high (i >= 2) nibble of
  ``ql[64h + 32*(i%2) + l]`` and bits ``2i, 2i+1`` of ``qh[32h + l]``;
  ``d * sc[v // 16] * (q - 32)``.
* Q2_K, 84 bytes: 16 bytes of 4-bit (scale, min) pairs, 64 bytes of 2-bit
  values, f16 d, f16 dmin. Value ``128h + 32i + l`` is bits ``2i, 2i+1`` of
  ``qs[32h + l]``; ``d*sc*q - dmin*m`` with sub-blocks of 16.
* Q3_K, 110 bytes: 32 bytes of high bits, 64 bytes of 2-bit low parts, 12
  bytes of sixteen packed 6-bit signed scales, f16 d. Value ``128h + 32i + l``
  is ``((qs[32h + l] >> 2i) & 3) - 4*(1 - hbit)`` where hbit is bit
  ``4h + i`` of ``hmask[l]``; ``d * (sc - 32) * q`` with sub-blocks of 16.

The 6-bit scale packing of Q4_K / Q5_K (llama.cpp's ``get_scale_min_k4``),
for sub-block s < 4: ``sc = b[s] & 63``, ``m = b[s+4] & 63``; for s >= 4:
``sc = (b[s+4] & 15) | (b[s-4] >> 6) << 4``, ``m = (b[s+4] >> 4) | (b[s] >> 6) << 4``.

The dequantizers round as llama.cpp's reference does (the sub-block factors
``d*sc`` and ``dmin*m`` in float32 first, then ``factor*q - min``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .layouts import BlockLayout, register_layout

QK_K = 256


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The f16 at byte ``at`` of every block, as float32 [nblocks, 1]."""
    return np.ascontiguousarray(blocks[:, at:at + 2]).view("<f2").astype(np.float32)


def scale_min_k4(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 packed bytes per block -> (scales, mins), each uint8 [nblocks, 8]."""
    b = packed.astype(np.uint8)
    lo, mid, top = b[:, 0:4], b[:, 4:8], b[:, 8:12]
    sc = np.concatenate([lo & 63, (top & 15) | ((lo >> 6) << 4)], axis=1)
    mn = np.concatenate([mid & 63, (top >> 4) | ((mid >> 6) << 4)], axis=1)
    return sc, mn


def _nibbles_by_subblock(qs: np.ndarray) -> np.ndarray:
    """128 bytes of nibbles per block -> uint8 [nblocks, 8, 32] in value order."""
    q = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([q & 15, q >> 4], axis=2).reshape(-1, 8, 32)


@dataclass(frozen=True)
class Q4KLayout(BlockLayout):
    def dequant_blocks(self, blocks: np.ndarray) -> np.ndarray:
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)
        sc, mn = scale_min_k4(blocks[:, 4:16])
        q = _nibbles_by_subblock(blocks[:, 16:144]).astype(np.float32)
        f = (d * sc.astype(np.float32))[:, :, None]
        m = (dmin * mn.astype(np.float32))[:, :, None]
        return (f * q - m).reshape(-1, QK_K)


@dataclass(frozen=True)
class Q5KLayout(BlockLayout):
    def dequant_blocks(self, blocks: np.ndarray) -> np.ndarray:
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)
        sc, mn = scale_min_k4(blocks[:, 4:16])
        qh = blocks[:, 16:48]                                    # [n, 32]
        bit = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # [n, 8, 32]
        q = (_nibbles_by_subblock(blocks[:, 48:176]) | (bit << 4)).astype(np.float32)
        f = (d * sc.astype(np.float32))[:, :, None]
        m = (dmin * mn.astype(np.float32))[:, :, None]
        return (f * q - m).reshape(-1, QK_K)


@dataclass(frozen=True)
class Q6KLayout(BlockLayout):
    def dequant_blocks(self, blocks: np.ndarray) -> np.ndarray:
        ql = blocks[:, 0:128].reshape(-1, 2, 2, 32)              # [n, half, i%2, l]
        qh = blocks[:, 128:192].reshape(-1, 2, 1, 32)            # [n, half, 1, l]
        sc = blocks[:, 192:208].view(np.int8).astype(np.float32)  # [n, 16]
        d = _f16(blocks, 208)
        lo = np.concatenate([ql & 15, ql >> 4], axis=2)          # [n, half, i, l]
        hi = (qh >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3
        q = (lo | (hi << 4)).astype(np.int16) - 32
        f = (d * sc)[:, :, None]                                 # [n, 16, 1]
        return (f * q.reshape(-1, 16, 16).astype(np.float32)).reshape(-1, QK_K)


@dataclass(frozen=True)
class Q2KLayout(BlockLayout):
    def dequant_blocks(self, blocks: np.ndarray) -> np.ndarray:
        packed = blocks[:, 0:16]
        qs = blocks[:, 16:80].reshape(-1, 2, 1, 32)
        d, dmin = _f16(blocks, 80), _f16(blocks, 82)
        q = (qs >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3
        f = (d * (packed & 15).astype(np.float32))[:, :, None]
        m = (dmin * (packed >> 4).astype(np.float32))[:, :, None]
        return (f * q.reshape(-1, 16, 16).astype(np.float32) - m).reshape(-1, QK_K)


def scales_q3k(packed: np.ndarray) -> np.ndarray:
    """12 packed bytes per block -> the sixteen signed scales, int8 [nblocks, 16]."""
    b = packed.astype(np.uint8)
    low = np.concatenate([b[:, 0:8] & 15, b[:, 0:8] >> 4], axis=1)
    top = b[:, 8:12]
    high = np.concatenate([(top >> (2 * k)) & 3 for k in range(4)], axis=1)
    return ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8)


@dataclass(frozen=True)
class Q3KLayout(BlockLayout):
    def dequant_blocks(self, blocks: np.ndarray) -> np.ndarray:
        hmask = blocks[:, 0:32]
        qs = blocks[:, 32:96].reshape(-1, 2, 1, 32)
        sc = scales_q3k(blocks[:, 96:108]).astype(np.float32)
        d = _f16(blocks, 108)
        low = ((qs >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3).reshape(-1, 8, 32)
        hbit = (hmask[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
        q = low.astype(np.int8) - ((1 - hbit) << 2).astype(np.int8)
        f = (d * sc)[:, :, None]
        return (f * q.reshape(-1, 16, 16).astype(np.float32)).reshape(-1, QK_K)


for _lay in (Q4KLayout("Q4_K", 1, "u1", QK_K, 144), Q5KLayout("Q5_K", 1, "u1", QK_K, 176),
             Q6KLayout("Q6_K", 1, "u1", QK_K, 210), Q2KLayout("Q2_K", 1, "u1", QK_K, 84),
             Q3KLayout("Q3_K", 1, "u1", QK_K, 110)):
    register_layout(_lay)
