"""Decoders for GGUF's simple block quant types (BF16, Q8_0, Q4_0, Q4_1,
Q5_0, Q5_1): stored blocks -> float32 vectors in registers, for the matmul,
qmatmul and embedding loops of ``matmul/float_tiles``. Byte layouts: ``ir/quant/gguf.py``.

Row ``r`` of an ``[N, K]`` matrix is ``K/32`` consecutive blocks starting at
byte ``r * (K/32) * block_bytes``; a block never crosses a row. ``step`` is
a whole number of blocks, so every column a decode call sees is a multiple
of 32 and each vector piece lies inside one block at a static offset: the
block address is computed once per call, a piece's quants are one small
integer vector load (plus a mask or shift for nibbles), and the block's
scale is one float16 load.

Two ways to turn 4/5-bit quants into floats:

* portable: mask/shift the nibbles, add the high bit and the -8/-16 bias
  as integers, convert (``sitofp``), multiply by the splat scale;
* AVX-512 (vector width 16): a block has only 16 (32 for 5 bits) distinct
  values, so build them once per block (``d * (q + bias) [+ m]``, one
  vector multiply) and pick each lane's value with a variable permute
  (``vpermps``, ``vpermi2ps``), which reads only the low 4 (5) index bits:
  no masking, no conversion, no per-vector multiply. About 20% faster
  matvec on znver4, where the portable path is bound by vector throughput.

Both compute ``d * (q + bias)`` then ``+ m`` in float32 as the numpy
reference does, so decoded weights (and embedding rows) are bit-exact.

Deferred scales: the symmetric types (Q8_0, and the portable Q4_0/Q5_0)
return unscaled quants and the block scale when the caller passes
``defer=True`` and the call covers one block, so matvec multiplies the
block's partial dot product once. With ``defer="blocks"`` they return one
scale per block of the call (a list; the vectors split evenly between
blocks), for a caller that keeps one partial sum per block.
"""
from __future__ import annotations

import llvmlite.ir as ir

from ..emit import F32, I32, KernelBuilder, i64
from ..simd import HALF, I8, I16, call, permutes, vconst
from .float_tiles import Decoder

#: no fast-math flags: decoded weights must equal the numpy reference exactly
EXACT: tuple[str, ...] = ()


class BF16Decoder(Decoder):
    """bfloat16 values: zero-extend to 32 bits, shift into the high half."""

    def __init__(self, kb: KernelBuilder, raw: ir.Value, n: int, k: int, qt=None) -> None:
        super().__init__(kb, raw, n, k, qt)
        self.w = kb.b.bitcast(raw, ir.PointerType(I16))

    def decode(self, row, col, widths, align, defer=False):
        kb, b = self.kb, self.kb.b
        base = b.add(b.mul(row, i64(self.k)), col)
        out, off = [], 0
        for w in widths:
            h = b.zext(kb.vload(self.w, b.add(base, i64(off)), w), ir.VectorType(I32, w))
            h = b.shl(h, vconst(I32, [16] * w))
            out.append(b.bitcast(h, kb.vtype(w)))
            off += w
        return out, None


class Block:
    """What one decode call knows about one block: its address, scale,
    offset, and (lazily) shared loads such as the widened quant bytes."""

    def __init__(self, bp: ir.Value, d: ir.Value, m: ir.Value | None) -> None:
        self.bp, self.d, self.m = bp, d, m
        self.cache: dict[str, ir.Value] = {}


class GGUFBlockDecoder(Decoder):
    """Common part of the block types whose block has one scale ``d`` (and
    maybe an offset ``m``): the type's row (``qt``) says the block's size,
    bytes and where ``d`` and ``m`` live; subclasses give ``quants``: the
    integer values ``q + bias`` of a piece of one block as a float32 vector
    (so the weight is ``quants * d [+ m]``); ``values`` may instead return
    the finished (scaled) weights, or None to use ``quants``."""

    decode_unroll = 4

    def __init__(self, kb: KernelBuilder, raw: ir.Value, n: int, k: int, qt) -> None:
        super().__init__(kb, raw, n, k, qt)
        #: bytes and values per block (a power of two: 32, QSF's 64)
        self.block_bytes, self.qk = qt.block_bytes, qt.block
        #: byte offset of the float16 scale ``d`` (None: the type reads its scale otherwise,
        #: ``block_scale``) and offset ``m`` (None: symmetric, value = q * d)
        self.d_at = qt.at("d") if qt.has("d") else None
        self.m_at = qt.at("m") if qt.has("m") else None
        if k % self.qk:
            raise ValueError(f"row length {k} is not a multiple of the block size {self.qk}")
        self.nb = k // self.qk

    def step(self, unroll: int) -> int:
        s = self.kb.vw * unroll
        return max(self.qk, s - s % self.qk)

    # --- per-type parts ---------------------------------------------------------------
    def quants(self, blk: Block, o: int, w: int) -> ir.Value:
        raise NotImplementedError

    def values(self, blk: Block, o: int, w: int) -> ir.Value | None:
        return None

    def block_scale(self, bp: ir.Value) -> ir.Value:
        """The float32 scale d of the block at ``bp``: its float16 field ``d``."""
        return self._f16(bp, self.d_at)

    # --- loads ----------------------------------------------------------------------------
    def _f16(self, bp: ir.Value, at: int) -> ir.Value:
        b = self.kb.b
        p = b.bitcast(self.kb.gep(bp, at), ir.PointerType(HALF))
        return b.fpext(b.load(p, align=1), F32)

    def _u32(self, bp: ir.Value, at: int) -> ir.Value:
        b = self.kb.b
        return b.load(b.bitcast(self.kb.gep(bp, at), ir.PointerType(I32)), align=1)

    # --- the Decoder interface ----------------------------------------------------------
    def decode(self, row, col, widths, align, defer=False):
        kb, b = self.kb, self.kb.b
        qk = self.qk
        assert align == 0 or align % qk == 0, (align, widths)
        first = b.add(b.mul(row, i64(self.nb)), b.lshr(col, i64(qk.bit_length() - 1)))   # col // qk
        base = b.mul(first, i64(self.block_bytes))
        blocks: dict[int, Block] = {}
        vecs: list[ir.Value] = []
        scaled: list[bool] = []
        off = 0
        for w in widths:
            j, o = divmod(off, qk)
            assert o + w <= qk, (off, w)
            if j not in blocks:
                bp = kb.gep(self.raw, b.add(base, i64(j * self.block_bytes)))
                blocks[j] = Block(bp, self.block_scale(bp), None if self.m_at is None else self._f16(bp, self.m_at))
            v = self.values(blocks[j], o, w)
            scaled.append(v is not None)
            vecs.append(v if v is not None else self.quants(blocks[j], o, w))
            off += w
        nblk = len(blocks)
        can_defer = self.m_at is None and not any(scaled)
        if can_defer and defer == "blocks" and len(widths) % nblk == 0 and len(set(widths)) == 1:
            return vecs, [blocks[j].d for j in sorted(blocks)]
        if can_defer and defer and nblk == 1:
            return vecs, blocks[0].d
        out, off = [], 0
        for v, w, done in zip(vecs, widths, scaled):
            if not done:
                blk = blocks[off // qk]
                v = b.fmul(v, kb.splat(blk.d, w), flags=EXACT)
                if blk.m is not None:
                    v = b.fadd(v, kb.splat(blk.m, w), flags=EXACT)
            out.append(v)
            off += w
        return out, None


class Q8_0Decoder(GGUFBlockDecoder):
    def quants(self, blk, o, w):
        return self.kb.b.sitofp(self.kb.vload(blk.bp, self.qt.at("qs") + o, w), self.kb.vtype(w))


class NibbleDecoder(GGUFBlockDecoder):
    """Q4_0, Q4_1, Q5_0, Q5_1: 16 bytes of nibble pairs at ``qs_at`` (low
    nibbles are values 0..15, high nibbles 16..31), for 5 bits a uint32 of
    high bits at ``qh_at`` (bit j belongs to value j); q + ``bias`` times d
    (bias: minus the type's zero point)."""

    def __init__(self, kb, raw, n, k, qt):
        super().__init__(kb, raw, n, k, qt)
        self.qs_at = qt.at("qs")
        self.qh_at = qt.at("qh") if qt.has("qh") else None
        self.bias = -qt.zero
        self.lut = permutes(kb.target, kb.vw)

    def _nibbles(self, blk: Block, o: int, w: int) -> ir.Value:
        """<w x i8> nibbles of values o..o+w-1."""
        b = self.kb.b
        half = self.qk // 2
        high = o >= half
        v = self.kb.vload(blk.bp, self.qs_at + o - (half if high else 0), w)
        return b.lshr(v, vconst(I8, [4] * w)) if high else b.and_(v, vconst(I8, [0x0F] * w))

    def _high_bit(self, blk: Block, o: int, w: int) -> ir.Value:
        """<w x i1>: is the fifth bit of values o..o+w-1 set?"""
        b = self.kb.b
        if "qh" not in blk.cache:
            blk.cache["qh"] = self._u32(blk.bp, self.qh_at)
        qh = self.kb.splat(blk.cache["qh"], w)
        masked = b.and_(qh, vconst(I32, [1 << (o + i) for i in range(w)]))
        return b.icmp_unsigned("!=", masked, vconst(I32, [0] * w))

    def quants(self, blk, o, w):
        b, vt = self.kb.b, self.kb.vtype(w)
        nib = self._nibbles(blk, o, w)
        if self.qh_at is None:
            return b.sitofp(b.add(nib, vconst(I8, [self.bias] * w)), vt)
        hi = b.select(self._high_bit(blk, o, w), vconst(I32, [16 + self.bias] * w), vconst(I32, [self.bias] * w))
        return b.sitofp(b.add(b.zext(nib, ir.VectorType(I32, w)), hi), vt)

    def values(self, blk, o, w):
        if not self.lut or w != 16:
            return None
        kb, b = self.kb, self.kb.b
        v16 = ir.VectorType(I32, 16)
        if "tables" not in blk.cache:
            # the block's 16 (32) possible weights, as float32 vectors
            tables = []
            for lo in range(0, 32 if self.qh_at is not None else 16, 16):
                t = b.fmul(vconst(F32, [float(lo + i + self.bias) for i in range(16)]), kb.splat(blk.d, 16), flags=EXACT)
                if blk.m is not None:
                    t = b.fadd(t, kb.splat(blk.m, 16), flags=EXACT)
                tables.append(t)
            blk.cache["tables"] = tables
            blk.cache["bytes"] = b.zext(kb.vload(blk.bp, self.qs_at, 16), v16)
        tables, qs = blk.cache["tables"], blk.cache["bytes"]
        # lane i of qs is byte i: the low nibble is value i, the high nibble
        # value i + 16; a permute reads only the low 4 (5) bits of its index
        idx = b.lshr(qs, vconst(I32, [4] * 16)) if o else qs
        if self.qh_at is None:
            return call(kb, "llvm.x86.avx512.permvar.sf.512", kb.vtype(16), [tables[0], idx])
        if not o:
            idx = b.and_(idx, vconst(I32, [0x0F] * 16))
        idx = b.or_(idx, b.select(self._high_bit(blk, o, 16), vconst(I32, [16] * 16), vconst(I32, [0] * 16)))
        return call(kb, "llvm.x86.avx512.vpermi2var.ps.512", kb.vtype(16), [tables[0], idx, tables[1]])
