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
``d*sc`` and ``dmin*m`` in float32 first, then ``factor*q - min``). Field
offsets are the types' rows in ``ir.quant.table``.

``int_superblocks`` gives the integer view the K-quants' integer path
(``ir.int_dot``) multiplies: value = d * sc[s] * q - dmin * m[s].
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .base import BlockLayout

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
class KQuantLayout(BlockLayout):
    """A K-quant super-block type: ``ints`` reads a block's integers and
    factors once, for the dequantizer and the integer path alike."""

    def ints(self, blk: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, np.ndarray | None,
                                            np.ndarray]:
        """(d [nb], dmin [nb] | None, sc int [nb, S], m int [nb, S] | None,
        q int16 [nb, 256]) with value = d * sc[s] * q - dmin * m[s]."""
        raise NotImplementedError

    def int_superblocks(self, raw: np.ndarray, n: int, k: int) -> "KQuantInts":
        """The integer view of a [n, k] weight's stored bytes."""
        nb = k // QK_K
        d, dmin, sc, m, q = self.ints(np.asarray(raw, np.uint8).reshape(n * nb, self.block_bytes))
        S = sc.shape[1]
        return KQuantInts(d.reshape(n, nb), None if dmin is None else dmin.reshape(n, nb),
                          sc.astype(np.int32).reshape(n, nb, S),
                          None if m is None else m.astype(np.int32).reshape(n, nb, S), q.reshape(n, nb, QK_K))


@dataclass
class KQuantInts:
    """A K-quant weight's super-blocks as integers and float factors:
    value = d * sc[s] * q - dmin * m[s] for the value's sub-block s."""

    d: np.ndarray            # float32 [N, nb]
    dmin: np.ndarray | None  # float32 [N, nb]; None for Q3_K, Q6_K
    sc: np.ndarray           # int32 [N, nb, S]: S = 8 sub-blocks of 32 (Q4_K, Q5_K), 16 of 16 (others)
    m: np.ndarray | None     # int32 [N, nb, S]; None for Q3_K, Q6_K
    q: np.ndarray            # int16 [N, nb, 256]: 0..3 (Q2_K), -4..3 (Q3_K), 0..15, 0..31, -32..31 (Q6_K)


class _Scaled4(KQuantLayout):
    """Q4_K and Q5_K: eight sub-blocks of 32, 6-bit scales and minimums."""

    def dequant_blocks(self, blocks: np.ndarray) -> np.ndarray:
        d, dmin = _f16(blocks, self.at("d")), _f16(blocks, self.at("dmin"))
        sc, mn = scale_min_k4(blocks[:, self.at("scales"):self.at("scales") + 12])
        q = self.subblock_quants(blocks).astype(np.float32)
        f = (d * sc.astype(np.float32))[:, :, None]
        m = (dmin * mn.astype(np.float32))[:, :, None]
        return (f * q - m).reshape(-1, QK_K)

    def subblock_quants(self, blocks: np.ndarray) -> np.ndarray:
        """uint8 [nblocks, 8, 32] in value order."""
        q = _nibbles_by_subblock(blocks[:, self.at("qs"):self.at("qs") + 128])
        if self.qt.has("qh"):
            qh = blocks[:, self.at("qh"):self.at("qh") + 32]                            # [n, 32]
            q = q | (((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4)  # [n, 8, 32]
        return q

    def ints(self, blk):
        sc, mn = scale_min_k4(blk[:, self.at("scales"):self.at("scales") + 12])
        return (_f16(blk, self.at("d"))[:, 0], _f16(blk, self.at("dmin"))[:, 0], sc, mn,
                self.subblock_quants(blk).astype(np.int16).reshape(-1, QK_K))


@dataclass(frozen=True)
class Q4KLayout(_Scaled4):
    pass


@dataclass(frozen=True)
class Q5KLayout(_Scaled4):
    pass


@dataclass(frozen=True)
class Q6KLayout(KQuantLayout):
    def quants(self, blocks: np.ndarray) -> np.ndarray:
        """The signed quants, int16 [nblocks, 256] (stored u = q + 32)."""
        ql = blocks[:, self.at("ql"):self.at("ql") + 128].reshape(-1, 2, 2, 32)   # [n, half, i%2, l]
        qh = blocks[:, self.at("qh"):self.at("qh") + 64].reshape(-1, 2, 1, 32)    # [n, half, 1, l]
        lo = np.concatenate([ql & 15, ql >> 4], axis=2)                           # [n, half, i, l]
        hi = (qh >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3
        return ((lo | (hi << 4)).astype(np.int16) - self.qt.zero).reshape(-1, QK_K)

    def dequant_blocks(self, blocks: np.ndarray) -> np.ndarray:
        sc = blocks[:, self.at("scales"):self.at("scales") + 16].view(np.int8).astype(np.float32)  # [n, 16]
        d = _f16(blocks, self.at("d"))
        f = (d * sc)[:, :, None]                                                  # [n, 16, 1]
        return (f * self.quants(blocks).reshape(-1, 16, 16).astype(np.float32)).reshape(-1, QK_K)

    def ints(self, blk):
        sc = blk[:, self.at("scales"):self.at("scales") + 16].view(np.int8)
        return _f16(blk, self.at("d"))[:, 0], None, sc, None, self.quants(blk)


def _two_bits(qs: np.ndarray) -> np.ndarray:
    """64 bytes of 2-bit fields per block -> uint8 [nblocks, 256] in value
    order (value 128h + 32i + l is bits 2i, 2i+1 of byte 32h + l)."""
    q = qs.reshape(-1, 2, 1, 32)
    return ((q >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3).reshape(-1, QK_K)


@dataclass(frozen=True)
class Q2KLayout(KQuantLayout):
    def dequant_blocks(self, blocks: np.ndarray) -> np.ndarray:
        packed = blocks[:, self.at("scales"):self.at("scales") + 16]
        d, dmin = _f16(blocks, self.at("d")), _f16(blocks, self.at("dmin"))
        q = _two_bits(blocks[:, self.at("qs"):self.at("qs") + 64])
        f = (d * (packed & 15).astype(np.float32))[:, :, None]
        m = (dmin * (packed >> 4).astype(np.float32))[:, :, None]
        return (f * q.reshape(-1, 16, 16).astype(np.float32) - m).reshape(-1, QK_K)

    def ints(self, blk):
        packed = blk[:, self.at("scales"):self.at("scales") + 16]
        return (_f16(blk, self.at("d"))[:, 0], _f16(blk, self.at("dmin"))[:, 0], packed & 15, packed >> 4,
                _two_bits(blk[:, self.at("qs"):self.at("qs") + 64]).astype(np.int16))


def scales_q3k(packed: np.ndarray) -> np.ndarray:
    """12 packed bytes per block -> the sixteen signed scales, int8 [nblocks, 16]."""
    b = packed.astype(np.uint8)
    low = np.concatenate([b[:, 0:8] & 15, b[:, 0:8] >> 4], axis=1)
    top = b[:, 8:12]
    high = np.concatenate([(top >> (2 * k)) & 3 for k in range(4)], axis=1)
    return ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8)


@dataclass(frozen=True)
class Q3KLayout(KQuantLayout):
    def quants(self, blocks: np.ndarray) -> np.ndarray:
        """The signed quants -4..3, int8 [nblocks, 256]: two low bits, minus 4
        where the high bit (of hmask) is clear."""
        hmask = blocks[:, self.at("hmask"):self.at("hmask") + 32]
        low = _two_bits(blocks[:, self.at("qs"):self.at("qs") + 64]).reshape(-1, 8, 32)
        hbit = (hmask[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
        return (low.astype(np.int8) - ((1 - hbit) << 2).astype(np.int8)).reshape(-1, QK_K)

    def dequant_blocks(self, blocks: np.ndarray) -> np.ndarray:
        sc = scales_q3k(blocks[:, self.at("scales"):self.at("scales") + 12]).astype(np.float32)
        d = _f16(blocks, self.at("d"))
        f = (d * sc)[:, :, None]
        return (f * self.quants(blocks).reshape(-1, 16, 16).astype(np.float32)).reshape(-1, QK_K)

    def ints(self, blk):
        sc = scales_q3k(blk[:, self.at("scales"):self.at("scales") + 12])
        return _f16(blk, self.at("d"))[:, 0], None, sc, None, self.quants(blk).astype(np.int16)
