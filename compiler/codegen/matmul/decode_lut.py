"""Decoders for GGUF's table types (IQ4_NL, IQ4_XS, MXFP4): 4-bit indices
into a 16-entry table of int8 values (the layout's ``kvalues``, read from
``ir/quant/lut.py``), for the matmul, qmatmul and embedding loops of
``matmul/float_tiles``. Byte layouts and the float32 order: ``ir/quant/lut.py``.

A block has only 16 possible weights, so where the target has 16-lane float
permutes (AVX-512, vector width 16) the decoder builds them once per
(sub-)block with one vector multiply (``table * d``, the reference's
float32 product per entry) and picks each lane's with ``vpermps``, which
reads only the low 4 bits of its index: the block's 16 quant bytes,
widened once, are the indices of its low nibbles and, shifted right by 4,
of its high ones. Elsewhere a piece's nibbles become table values with one
byte lookup (``simd.lookup16``: ``vpshufb``, or a select tree), are
converted and multiplied by the scale.

* IQ4_NL: ``GGUFBlockDecoder``'s loop (32-value blocks, float16 d); the
  portable path returns ``K[i]`` and the loop multiplies by d (or defers d
  to the block's partial dot product, as Q4_0 does).
* MXFP4: the same with the scale 2^(e - 128) made from the exponent byte by
  its bits (``block_scale``), as ggml's ``GGML_E8M0_TO_FP32_HALF``.
* IQ4_XS: a ``KQuantDecoder`` (256-value super-blocks, one per decode
  call): the 8 sub-block factors d * (ls - 32) (exact) are computed once
  per call with vector integer ops on the packed scale bits and kept in the
  factor buffer; a piece multiplies its table values by its sub-block's
  factor, or on AVX-512 permutes its sub-block's table of 16 weights.

No fast-math flags (``EXACT``): decoded weights equal the numpy reference
bit for bit.
"""
from __future__ import annotations

import llvmlite.ir as ir

from ..emit import F32, I32, i64
from ..simd import I8, I16, call, lookup16, permutes, vconst
from .decode_gguf import EXACT, NibbleDecoder
from .decode_kquants import KQuantDecoder

_PERMUTE = "llvm.x86.avx512.permvar.sf.512"


class LUTDecoder(NibbleDecoder):
    """IQ4_NL: 32-value blocks, float16 d, value d * K[i]."""

    def __init__(self, kb, raw, n, k, qt):
        super().__init__(kb, raw, n, k, qt)
        self.kvalues = qt.layout.kvalues

    def quants(self, blk, o, w):
        kv = lookup16(self.kb, self.kvalues, self._nibbles(blk, o, w))
        return self.kb.b.sitofp(kv, self.kb.vtype(w))

    def values(self, blk, o, w):
        if not self.lut or w != 16:
            return None
        kb, b = self.kb, self.kb.b
        if "table" not in blk.cache:
            blk.cache["table"] = b.fmul(vconst(F32, [float(v) for v in self.kvalues]), kb.splat(blk.d, 16),
                                        flags=EXACT)
            blk.cache["bytes"] = b.zext(kb.vload(blk.bp, self.qs_at, 16), ir.VectorType(I32, 16))
        idx = blk.cache["bytes"]
        if o:
            idx = b.lshr(idx, vconst(I32, [4] * 16))
        return call(kb, _PERMUTE, kb.vtype(16), [blk.cache["table"], idx])


class MXFP4Decoder(LUTDecoder):
    """MXFP4: the scale is 2^(e - 128) from the exponent byte e."""

    def block_scale(self, bp):
        b = self.kb.b
        e = b.zext(b.load(self.kb.gep(bp, self.qt.at("e"))), I32)
        small = b.shl(ir.Constant(I32, 0x00200000), b.and_(e, ir.Constant(I32, 1)))     # e < 2: subnormal
        normal = b.shl(b.sub(e, ir.Constant(I32, 1)), ir.Constant(I32, 23))
        bits = b.select(b.icmp_unsigned("<", e, ir.Constant(I32, 2)), small, normal)
        return b.bitcast(bits, F32)


class IQ4XSDecoder(KQuantDecoder):
    """IQ4_XS: super-blocks of 256, 8 sub-blocks of 32 with factors d * (ls - 32)."""

    def __init__(self, kb, raw, n, k, qt):
        super().__init__(kb, raw, n, k, qt)
        self.kvalues = qt.layout.kvalues
        self.lut = permutes(kb.target, kb.vw)

    def factors(self, blk) -> None:
        """Buffer lanes 0-7: d * (ls_s - 32), ls_s = nibble s of the u32
        ``scales_l`` | bits 2s, 2s+1 of the u16 ``scales_h`` << 4."""
        def make():
            kb, b = self.kb, self.kb.b
            lo = b.load(b.bitcast(kb.gep(blk.ptr, self.at("scales_l")), ir.PointerType(I32)), align=1)
            hi = b.zext(b.load(b.bitcast(kb.gep(blk.ptr, self.at("scales_h")), ir.PointerType(I16)), align=1), I32)
            lo = b.and_(b.lshr(kb.splat(lo, 8), vconst(I32, [4 * s for s in range(8)])), vconst(I32, [15] * 8))
            hi = b.and_(b.lshr(kb.splat(hi, 8), vconst(I32, [2 * s for s in range(8)])), vconst(I32, [3] * 8))
            ls = b.sub(b.or_(lo, b.shl(hi, vconst(I32, [4] * 8))), vconst(I32, [32] * 8))
            d = kb.splat(b.extract_element(blk.f16s(self.at("d"), 1), i64(0)), 8)
            self.store_factors(b.fmul(d, b.sitofp(ls, ir.VectorType(F32, 8)), flags=EXACT))
        blk.once("factors", make)

    def piece(self, blk, io, w):
        kb, b = self.kb, self.kb.b
        s, r = divmod(io, 32)
        high, l0 = divmod(r, 16)
        assert l0 + w <= 16, (io, w)
        at = self.at("qs") + 16 * s
        self.factors(blk)
        if self.lut and w == 16:
            def table():
                f = self.factor(blk, s, 16)
                return b.fmul(vconst(F32, [float(v) for v in self.kvalues]), f, flags=EXACT)
            tab = blk.once(("table", s), table)
            idx = blk.once(("bytes", s), lambda: b.zext(blk.bytes(at, 16), ir.VectorType(I32, 16)))
            if high:
                idx = b.lshr(idx, vconst(I32, [4] * 16))
            return call(kb, _PERMUTE, kb.vtype(16), [tab, idx])
        q = blk.bytes(at + l0, w)
        q = b.lshr(q, vconst(I8, [4] * w)) if high else b.and_(q, vconst(I8, [15] * w))
        kv = b.sitofp(lookup16(kb, self.kvalues, q), kb.vtype(w))
        return b.fmul(kv, self.factor(blk, s, w, shared=True), flags=EXACT)

