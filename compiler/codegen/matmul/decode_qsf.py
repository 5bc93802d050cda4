"""Decoders for QSF's block quant types (QSF_Q8, QSF_Q4, QSF_Q2, QSF_Q2S,
QSF_TERNARY): 64-value blocks -> float32 vectors in registers, for the
matmul, qmatmul and embedding loops of ``matmul/float_tiles``. Byte layouts and the
float32 order of operations: ``ir/quant/qsf.py``.

They are ``GGUFBlockDecoder``s with ``qk = 64``: ``step`` is a whole number
of blocks, so a decode call starts at a block boundary; the block address
is computed once per call, its f16 fields are loaded once per block, and
every vector piece (at most 16 lanes) lies inside one block at a static
offset, inside one half (Q4: 32 nibbles) or quarter (Q2: 16 crumbs) of it:

* Q8: one ``<w x i8>`` load, ``sitofp``; times d.
* Q4: one byte load, mask (low half) or shift (high half), convert, ``- z``;
  times d.
* Q2 / Q2S: the piece's 16 bytes hold its values in bits 2k..2k+1
  (k = piece offset / 16): load, shift by 2k, mask with 3, convert; then
  ``* d + m`` (Q2) or ``- 1.5``, ``* d`` (Q2S).
* TERNARY: the 32-bit halves of the sign and zero masks are loaded once per
  block; a piece splats them, ANDs with its lanes' bits, compares, and
  selects ``d``, ``-d`` or ``0``.

On AVX-512 the 4- and 2-bit types instead look their 16-lane pieces up in
a per-block table of weights (``QSFDecoder``).

No fast-math flags anywhere in a decode (``EXACT``): the decoded weights
equal the numpy reference bit for bit. Types whose value is ``quants * d``
(Q8, Q4, Q2S) let a matvec defer d to the block's partial dot product, as
GGUF's symmetric types do. These are the float path; where the host has
VNNI, ``passes/int_dot.py`` puts QSF matmuls on the integer path instead
(``matmul/int_qsf``), and these decoders still serve embeddings and
graphs compiled without the pass.
"""
from __future__ import annotations

import llvmlite.ir as ir

from ..emit import F32, I32
from ..simd import I8, call, permutes, vconst
from .decode_gguf import EXACT, Block, GGUFBlockDecoder


class QSFDecoder(GGUFBlockDecoder):
    """The GGUF block loop with 64-value blocks, and the table path.

    Table path (AVX-512, 16-lane pieces; types that define ``table``): a
    4- or 2-bit block has at most 16 distinct weights, so build them once
    per block with the reference's float32 operations and pick each lane's
    weight with one ``vpermps``, which reads only the low 4 bits of its
    index: no mask, no conversion, no multiply per piece. The indices are
    the block's quant bytes, widened once per block, shifted right
    (``index``); for 2-bit quants the table repeats with period 4, so the
    bits above a lane's two do not matter. 15-30% faster matvec on a
    hot cache than the portable path."""

    #: True where the type has a table path
    tabled = False

    def __init__(self, kb, raw, n, k, qt):
        super().__init__(kb, raw, n, k, qt)
        self.at = qt.at
        self.lut = self.tabled and permutes(kb.target, kb.vw)

    # --- per-type parts of the table path ---------------------------------------------------
    def table(self, blk: Block) -> ir.Value:
        """<16 x float>: the weight for each 4-bit index."""
        raise NotImplementedError

    def index(self, o: int) -> tuple[int, int]:
        """(byte offset, right shift) of the indices of the 16-lane piece at ``o``."""
        raise NotImplementedError

    # --- shared ------------------------------------------------------------------------------
    def _field(self, blk: Block, key: str, make) -> ir.Value:
        """A per-block value computed once per decode call."""
        if key not in blk.cache:
            blk.cache[key] = make()
        return blk.cache[key]

    def _to_f32(self, q: ir.Value, w: int) -> ir.Value:
        return self.kb.b.sitofp(q, self.kb.vtype(w))

    def _crumbs(self, blk: Block, at: int, o: int, w: int) -> ir.Value:
        """<w x i8> 2-bit quants o..o+w-1 of the 16 bytes at ``at``: value
        i + 16k is bits 2k..2k+1 of byte i."""
        b = self.kb.b
        k, i = divmod(o, 16)
        assert i + w <= 16, (o, w)
        v = self.kb.vload(blk.bp, at + i, w)
        if k:
            v = b.lshr(v, vconst(I8, [2 * k] * w))
        return b.and_(v, vconst(I8, [3] * w)) if k < 3 else v

    def values(self, blk, o, w):
        if not self.lut or w != 16:
            return None  # portable: quants, then the loop's * d (+ m)
        kb, b = self.kb, self.kb.b
        at, shift = self.index(o)
        idx = self._field(blk, f"bytes{at}", lambda: b.zext(kb.vload(blk.bp, at, 16), ir.VectorType(I32, 16)))
        if shift:
            idx = b.lshr(idx, vconst(I32, [shift] * 16))
        tab = self._field(blk, "table", lambda: self.table(blk))
        return call(kb, "llvm.x86.avx512.permvar.sf.512", kb.vtype(16), [tab, idx])

    def _f16_field(self, blk: Block, at: int) -> ir.Value:
        return self._field(blk, f"f16.{at}", lambda: self._f16(blk.bp, at))


class QSFQ8Decoder(QSFDecoder):
    def quants(self, blk, o, w):
        return self._to_f32(self.kb.vload(blk.bp, self.at("qs") + o, w), w)


class QSFQ4Decoder(QSFDecoder):
    """(q - z) * d: ``quants`` is q - z (z a float16 field), the loop multiplies by d."""

    tabled = True

    def quants(self, blk, o, w):
        b = self.kb.b
        high, i = divmod(o, self.qk // 2)
        assert i + w <= self.qk // 2, (o, w)
        v = self.kb.vload(blk.bp, self.at("qs") + i, w)
        nib = b.lshr(v, vconst(I8, [4] * w)) if high else b.and_(v, vconst(I8, [0x0F] * w))
        return b.fsub(self._to_f32(nib, w), self.kb.splat(self._f16_field(blk, self.at("z")), w), flags=EXACT)

    def index(self, o):
        high, i = divmod(o, self.qk // 2)
        return self.at("qs") + i, 4 * high

    def table(self, blk):
        b, kb = self.kb.b, self.kb
        q_z = b.fsub(vconst(F32, [float(q) for q in range(16)]), kb.splat(self._f16_field(blk, self.at("z")), 16),
                     flags=EXACT)
        return b.fmul(q_z, kb.splat(blk.d, 16), flags=EXACT)


class QSFQ2Decoder(QSFDecoder):
    """q * d + m: the loop's multiply-then-add (m: the row's offset field)."""

    tabled = True

    def quants(self, blk, o, w):
        return self._to_f32(self._crumbs(blk, self.at("qs"), o, w), w)

    def index(self, o):
        return self.at("qs"), 2 * (o // 16)

    def table(self, blk):
        b, kb = self.kb.b, self.kb
        t = b.fmul(vconst(F32, [float(i & 3) for i in range(16)]), kb.splat(blk.d, 16), flags=EXACT)
        return b.fadd(t, kb.splat(blk.m, 16), flags=EXACT)


class QSFQ2SDecoder(QSFDecoder):
    """(q - 1.5) * d: ``quants`` is q - 1.5 (exact in float32)."""

    tabled = True

    def quants(self, blk, o, w):
        q = self._to_f32(self._crumbs(blk, self.at("qs"), o, w), w)
        return self.kb.b.fsub(q, vconst(F32, [1.5] * w), flags=EXACT)

    def index(self, o):
        return self.at("qs"), 2 * (o // 16)

    def table(self, blk):
        levels = vconst(F32, [(i & 3) - 1.5 for i in range(16)])
        return self.kb.b.fmul(levels, self.kb.splat(blk.d, 16), flags=EXACT)


class QSFTernaryDecoder(QSFDecoder):
    """A select of d, -d and 0 by the sign and zero masks."""

    def _bits(self, blk: Block, at: int, o: int, w: int) -> ir.Value:
        """<w x i1>: bit o+i of the u64 mask at ``at``, i < w."""
        b = self.kb.b
        h, i = divmod(o, 32)
        assert i + w <= 32, (o, w)
        word = self._field(blk, f"{at}.{h}", lambda: self._u32(blk.bp, at + 4 * h))
        lanes = vconst(I32, [1 << (i + j) for j in range(w)])
        return b.icmp_unsigned("!=", b.and_(self.kb.splat(word, w), lanes), vconst(I32, [0] * w))

    def values(self, blk, o, w):  # every width: no table path
        kb, b = self.kb, self.kb.b
        d = kb.splat(blk.d, w)
        signed = b.select(self._bits(blk, self.at("sign"), o, w), b.fneg(d), d)
        return b.select(self._bits(blk, self.at("zero"), o, w), kb.vzero(w), signed)
