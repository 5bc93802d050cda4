"""GGUF's ternary types of BitNet b1.58 files: TQ1_0 and TQ2_0, as llama.cpp
stores them. A super-block of 256 values shares one float16 scale ``d``;
each value is a code c in 0..2 and is ``(c - 1) * d`` (-d, 0 or +d), computed
in float32 as ggml does: ``float(c - 1) * d``.

* TQ1_0, 54 bytes: qs[48], qh[4], f16 d. Codes are base-3 digits, five to a
  qs byte and four to a qh byte, packed so that digit n of byte b is
  ``((b * 3^n) mod 256) * 3 >> 8`` (the byte is ceil(N * 256 / 243) of the
  digits' number N, most significant digit first). Values in order:

      0 .. 159    digit n of qs[m],      value 32n + m        (n < 5, m < 32)
      160 .. 239  digit n of qs[32 + m], value 160 + 16n + m  (n < 5, m < 16)
      240 .. 255  digit n of qh[j],      value 240 + 4n + j   (n < 4, j < 4)

* TQ2_0, 66 bytes: qs[64] of 2-bit codes, f16 d. Value 128h + 32l + m is
  bits 2l, 2l+1 of qs[32h + m] (h < 2, l < 4, m < 32), as Q2_K's quants.
  llama.cpp's quantizer writes codes 0..2; a code 3 reads as +2d.

The offsets of qs, qh and d, and the zero point 1 (code = signed quant + 1),
are the types' rows in ``ir.quant.table``.

The integer path (``act="q8k"``, llama.cpp's ``ggml_vec_dot_tq*_q8_K``)
sees a super-block as a K-quant with one sub-block of 256 values whose
integer scale is 1 and no minimum: ``ints`` gives d, sc = 1 and the signed
quants c - 1 (``KQuantLayout.int_superblocks``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .gguf import f16_at
from .kquants import QK_K, KQuantLayout

#: 3^n mod 256 for the digits of a byte (uint8 arithmetic wraps as ggml's does)
_POW3 = np.array([1, 3, 9, 27, 81], dtype=np.uint8)


def two_bit_codes(qs: np.ndarray) -> np.ndarray:
    """64 bytes of 2-bit codes [nblocks, 64] -> uint8 [nblocks, 256] in value
    order (value 128h + 32l + m: bits 2l, 2l+1 of byte 32h + m)."""
    q = qs.reshape(-1, 2, 1, 32)
    return ((q >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3).reshape(-1, QK_K)


def base3_digits(b: np.ndarray, n: int) -> np.ndarray:
    """Digits 0 .. n-1 of the bytes ``b`` [nblocks, m]: uint8 [nblocks, n, m] in 0..2."""
    p = b[:, None, :] * _POW3[:n, None]                                  # mod 256
    return ((p.astype(np.uint16) * 3) >> 8).astype(np.uint8)


@dataclass(frozen=True)
class TernaryLayout(KQuantLayout):
    """A ternary super-block type: subclasses give ``codes`` (uint8
    [nblocks, 256] in value order, code = quant + the row's ``zero``)."""

    def codes(self, blocks: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def quants(self, blocks: np.ndarray) -> np.ndarray:
        """The signed quants c - 1, int8 [nblocks, 256]."""
        return self.codes(blocks).astype(np.int8) - np.int8(self.qt.zero)

    def dequant_blocks(self, blocks: np.ndarray) -> np.ndarray:
        return f16_at(blocks, self.at("d")) * self.quants(blocks).astype(np.float32)

    def ints(self, blk):
        n = blk.shape[0]
        return (f16_at(blk, self.at("d"))[:, 0], None, np.ones((n, QK_K // self.qt.sub_block), np.int32), None,
                self.quants(blk).astype(np.int16))


@dataclass(frozen=True)
class TQ1Layout(TernaryLayout):
    def codes(self, blocks: np.ndarray) -> np.ndarray:
        qs, qh = self.at("qs"), self.at("qh")
        n = blocks.shape[0]
        return np.concatenate([base3_digits(blocks[:, qs:qs + 32], 5).reshape(n, 160),
                               base3_digits(blocks[:, qs + 32:qs + 48], 5).reshape(n, 80),
                               base3_digits(blocks[:, qh:qh + 4], 4).reshape(n, 16)], axis=1)


@dataclass(frozen=True)
class TQ2Layout(TernaryLayout):
    def codes(self, blocks: np.ndarray) -> np.ndarray:
        return two_bit_codes(blocks[:, self.at("qs"):self.at("qs") + 64])
