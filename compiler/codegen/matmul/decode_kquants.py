"""Decoders for GGUF's K-quants (Q2_K .. Q6_K): 256-value super-blocks
-> float32 vectors in registers, for the matmul / qmatmul / embedding loops
of ``matmul/float_tiles``. Byte layouts and value order: ``ir/quant/kquants.py``.

K is a multiple of 256 and ``step`` is one super-block, so a decode call
starts at a super-block boundary and every vector piece lies in one
sub-block at an offset known when the code is generated. Per call:

* the sub-block factors are computed once, with vector integer ops on the
  packed scale bytes (Q4_K / Q5_K: the eight 6-bit scale / min pairs of
  llama.cpp's ``get_scale_min_k4``, unpacked together as 16 bytes; Q2_K:
  sixteen 4-bit pairs; Q3_K: sixteen 6-bit signed scales), turned into
  float32 ``d*sc`` and ``dmin*m``, and stored to a small stack buffer;
* each piece loads its quant bytes as a ``<w x i8>`` vector, extracts its
  bits with and / shift / or in the byte domain (narrow ops; Q6_K's more
  numerous ones on 32 bytes at a time for 16-lane pieces), widens,
  converts, and applies its sub-block's factor (and min) with one
  multiply(-add) whose scalar operand is a broadcast load from that buffer.

Why the stack buffer: a factor that lives in a vector register must be
broadcast to all lanes by a shuffle, and on AVX-512 machines shuffles are
what the loop is short of (each piece already needs one to widen its bytes).
A broadcast *load* can instead be folded into the FMA as an embedded
``{1to16}`` operand. The loads are volatile so that LLVM neither forwards
the stores to them (which turns them back into shuffles) nor merges two
loads of one factor into one register (which keeps it from folding them).

Numerics: a value is ``fma(q, d*sc, -dmin*m)``, one rounding instead of
the numpy reference's two (Q3_K, Q6_K: ``q * (d*sc)``, exactly the reference).
"""
from __future__ import annotations

import llvmlite.ir as ir

from ir.quant import ACT_BLOCK

from ..emit import F32, I32, KernelBuilder, i64
from ..simd import HALF, I8, I16, shuffle, vconst
from .float_tiles import Decoder

#: values per super-block
QK_K = ACT_BLOCK["q8k"]


def q3k_scales_at(qt) -> int:
    """Where Q3_K's scales are read: 16 bytes ending with the 12 scale bytes
    and d (two quant bytes before them), never past the block."""
    return qt.at("scales") - 2


def i8s(w: int, v: int) -> ir.Constant:
    return vconst(I8, [v] * w)


def q3k_scales(b: ir.IRBuilder, s: ir.Value) -> ir.Value:
    """Q3_K's sixteen scales (6 bits, minus 32) as <16 x i16>, from the 16
    bytes at ``q3k_scales_at`` (packed byte p in lane 2 + p): scale j is the
    low (j < 8) or high nibble of byte j % 8, with bits 2(j // 4), 2(j // 4) + 1
    of byte 8 + j % 4 above it (llama.cpp's kmask1 / kmask2 unpacking)."""
    v16 = ir.VectorType(I16, 16)
    lo = b.zext(shuffle(b, s, None, [2 + j % 8 for j in range(16)]), v16)
    hi = b.zext(shuffle(b, s, None, [10 + j % 4 for j in range(16)]), v16)
    lo = b.and_(b.lshr(lo, vconst(I16, [4 * (j // 8) for j in range(16)])), vconst(I16, [15] * 16))
    hi = b.and_(b.lshr(hi, vconst(I16, [2 * (j // 4) for j in range(16)])), vconst(I16, [3] * 16))
    return b.sub(b.or_(lo, b.shl(hi, vconst(I16, [4] * 16))), vconst(I16, [32] * 16))


class _VolatileLoad(ir.LoadInstr):
    """``load volatile`` (llvmlite's builder has no flag for it)."""

    def descr(self, buf):
        super().descr(buf)
        buf[-1] = buf[-1].replace("load ", "load volatile ", 1)


def _load_volatile(b: ir.IRBuilder, ptr: ir.Value) -> ir.Value:
    ld = _VolatileLoad(b.block, ptr)
    ld.align = 4
    b._insert(ld)
    return ld


class _Block:
    """One super-block seen by a decode call: its address and the factors
    computed for it (once per call)."""

    def __init__(self, dec: "KQuantDecoder", ptr: ir.Value) -> None:
        self.dec, self.ptr = dec, ptr
        self.cache: dict = {}

    def once(self, key, make):
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]

    def bytes(self, at: int, w: int) -> ir.Value:
        return self.dec.kb.vload(self.ptr, at, w)

    def f16s(self, at: int, n: int) -> ir.Value:
        """``n`` float16 at byte ``at`` -> <n x float>."""
        b = self.dec.kb.b
        p = b.bitcast(self.dec.kb.gep(self.ptr, at), ir.PointerType(ir.VectorType(HALF, n)))
        return b.fpext(b.load(p, align=1), ir.VectorType(F32, n))


class KQuantDecoder(Decoder):
    """Common part: super-block addressing and the factor buffer.
    The type's row (``qt``) gives the super-block's bytes, its fields'
    offsets and the values per sub-block (``sub``); subclasses give
    ``piece(blk, io, w)``: the weights at in-block offsets io..io+w-1
    (inside one sub-block) as a float32 vector."""

    decode_unroll = 4

    def __init__(self, kb: KernelBuilder, raw: ir.Value, n: int, k: int, qt) -> None:
        super().__init__(kb, raw, n, k, qt)
        self.block_bytes, self.sub = qt.block_bytes, qt.sub_block
        self.at = qt.at
        if k % QK_K:
            raise NotImplementedError(f"K-quant rows must be a multiple of {QK_K}, got {k}")
        self.nb = k // QK_K  # super-blocks per row
        # the factor buffer, allocated in the entry block (decoders are made there)
        slots = kb.b.alloca(ir.ArrayType(F32, 32), name="kq_factors")
        slots.align = 64
        self.slots = kb.b.bitcast(slots, ir.PointerType(F32))

    def step(self, unroll: int) -> int:
        return QK_K

    def decode(self, row, col, widths, align, defer=False):
        kb, b = self.kb, self.kb.b
        if isinstance(col, ir.Constant):
            c0, colblk = int(col.constant), None
        elif align and align % QK_K == 0:
            c0, colblk = 0, b.lshr(col, i64(8))   # col // 256 (col >= 0)
        else:
            raise NotImplementedError(f"{type(self).__name__}: decode at a column aligned to {align}")
        first = b.mul(row, i64(self.nb))
        if colblk is not None:
            first = b.add(first, colblk)
        blocks: dict[int, _Block] = {}
        out, off = [], c0
        for w in widths:
            bi, io = divmod(off, QK_K)
            if io % self.sub + w > self.sub:
                raise NotImplementedError(f"a {w}-wide piece at {io} crosses a sub-block")
            if bi not in blocks:
                blocks[bi] = _Block(self, kb.gep(self.raw, b.mul(b.add(first, i64(bi)), i64(self.block_bytes))))
            out.append(self.piece(blocks[bi], io, w))
            off += w
        return out, None

    def piece(self, blk: _Block, io: int, w: int) -> ir.Value:
        raise NotImplementedError

    # helpers ---------------------------------------------------------------
    def widen(self, q: ir.Value, signed: bool = False) -> ir.Value:
        """<w x i8> -> <w x float>."""
        b, w = self.kb.b, q.type.count
        it = ir.VectorType(I32, w)
        return b.sitofp(b.sext(q, it) if signed else b.zext(q, it), self.kb.vtype(w))

    def store_factors(self, vec: ir.Value, at: int = 0) -> None:
        self.kb.vstore(vec, self.slots, at)

    def factor(self, blk: _Block, i: int, w: int, shared: bool = False) -> ir.Value:
        """Factor ``i`` of the call splat to ``w`` lanes (see the module
        docstring). ``shared``: one broadcast register for all its uses in
        this call, for a factor that several pieces multiply by."""
        def make():
            return self.kb.splat(_load_volatile(self.kb.b, self.kb.gep(self.slots, i)), w)
        return blk.once(("factor", i, w), make) if shared else make()


class _ScaleMinDecoder(KQuantDecoder):
    """Q4_K / Q5_K: ``d*sc[s]*q - dmin*m[s]``, 8 sub-blocks of 32; the 12
    packed scale bytes at offset 4."""

    def factors(self, blk: _Block) -> None:
        """Buffer lanes 0-7: ``d*sc[s]``; lanes 8-15: ``dmin*m[s]``."""
        def make():
            b = self.kb.b
            s = blk.bytes(self.at("scales"), 16)  # 12 scale bytes + 4 quant bytes (still in the block)
            # s < 4: sc = b[s] & 63, m = b[s+4] & 63
            # s >= 4: sc = b[s+4] & 15 | (b[s-4] >> 6) << 4, m = b[s+4] >> 4 | (b[s] >> 6) << 4
            lo = shuffle(b, s, None, [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11])
            hi = shuffle(b, s, None, [0, 0, 0, 0, 0, 1, 2, 3, 0, 0, 0, 0, 4, 5, 6, 7])
            v = b.or_(b.and_(lo, vconst(I8, [63] * 4 + [15] * 4 + [63] * 4 + [0] * 4)),
                      b.and_(b.lshr(lo, i8s(16, 4)), vconst(I8, [0] * 12 + [15] * 4)))
            v = b.or_(v, b.and_(b.lshr(hi, i8s(16, 2)), vconst(I8, ([0] * 4 + [0x30] * 4) * 2)))
            dd = shuffle(b, blk.f16s(self.at("d"), 2), None, [0] * 8 + [1] * 8)   # d x8, dmin x8 (dmin after d)
            self.store_factors(b.fmul(dd, self.widen(v)))
        blk.once("factors", make)

    def scaled(self, blk: _Block, q: ir.Value, s: int) -> ir.Value:
        """The float weights of quants ``q`` (<w x i8>) in sub-block ``s``."""
        w = q.type.count
        self.factors(blk)
        f = self.factor(blk, s, w, shared=True)   # both pieces of the sub-block
        m = self.kb.b.fneg(self.factor(blk, 8 + s, w))
        return self.kb.mul_add(self.widen(q), f, m)


class Q4KDecoder(_ScaleMinDecoder):
    """d, dmin, 12 scale bytes, 128 bytes of nibbles (value 64j + 32h + l is
    nibble h of byte 32j + l)."""

    def piece(self, blk, io, w):
        b = self.kb.b
        j, r = divmod(io, 64)
        h, l0 = divmod(r, 32)
        q = blk.bytes(self.at("qs") + 32 * j + l0, w)
        q = b.lshr(q, i8s(w, 4)) if h else b.and_(q, i8s(w, 15))
        return self.scaled(blk, q, io // 32)


class Q5KDecoder(_ScaleMinDecoder):
    """As Q4_K with 32 bytes of fifth bits (bit s of byte l is bit 4 of
    value 32s + l) before the nibbles."""

    def piece(self, blk, io, w):
        b = self.kb.b
        s, l0 = divmod(io, 32)
        j, h = divmod(s, 2)
        q = blk.bytes(self.at("qs") + 32 * j + l0, w)
        q = b.lshr(q, i8s(w, 4)) if h else b.and_(q, i8s(w, 15))
        qh = blk.bytes(self.at("qh") + l0, w)
        qh = b.shl(qh, i8s(w, 4 - s)) if s <= 4 else b.lshr(qh, i8s(w, s - 4))  # bit s -> bit 4
        q = b.or_(q, b.and_(qh, i8s(w, 16)))
        return self.scaled(blk, q, s)


class Q6KDecoder(KQuantDecoder):
    """128 bytes of low nibbles, 64 of high 2-bit parts, 16 int8 scales, f16
    d; the two halves of 128 values are laid out alike; q = u - zero (32)."""

    def quants(self, blk: _Block, hf: int, i: int, l0: int, w: int) -> ir.Value:
        """q - 32 (<w x i8>) of values 128hf + 32i + l0 .. + w-1: the low or
        high nibble of ql[64hf + 32(i%2) + l] and bits 2i, 2i+1 of qh[32hf + l]."""
        b = self.kb.b
        ql = blk.bytes(self.at("ql") + 64 * hf + 32 * (i % 2) + l0, w)
        ql = b.lshr(ql, i8s(w, 4)) if i >= 2 else b.and_(ql, i8s(w, 15))
        qh = blk.bytes(self.at("qh") + 32 * hf + l0, w)
        sh = 4 - 2 * i  # bits 2i, 2i+1 -> bits 4, 5
        qh = b.shl(qh, i8s(w, sh)) if sh > 0 else (b.lshr(qh, i8s(w, -sh)) if sh < 0 else qh)
        return b.sub(b.or_(ql, b.and_(qh, i8s(w, 0x30))), i8s(w, self.qt.zero))

    def piece(self, blk, io, w):
        b = self.kb.b
        hf, r = divmod(io, 128)
        i, l0 = divmod(r, 32)
        if w == 16:
            # 16-lane pieces (AVX-512): the byte ops on all 32 values of
            # (hf, i) at once, 256-bit ops that cost what a 128-bit one does
            q = shuffle(b, blk.once(("q", hf, i), lambda: self.quants(blk, hf, i, 0, 32)), None,
                        list(range(l0, l0 + w)))
        else:
            q = self.quants(blk, hf, i, l0, w)

        def factors():  # d * sc for the 16 sub-blocks
            sc = self.widen(blk.bytes(self.at("scales"), 16), signed=True)
            d = self.kb.splat(b.extract_element(blk.f16s(self.at("d"), 1), i64(0)), 16)
            self.store_factors(b.fmul(d, sc))
        blk.once("factors", factors)
        return b.fmul(self.widen(q, signed=True), self.factor(blk, io // 16, w))


def _shift_bits(b: ir.IRBuilder, v: ir.Value, sh: int) -> ir.Value:
    """Bytes of v shifted left by sh (right by -sh)."""
    w = v.type.count
    if sh > 0:
        return b.shl(v, i8s(w, sh))
    return b.lshr(v, i8s(w, -sh)) if sh < 0 else v


class Q2KDecoder(KQuantDecoder):
    """16 (scale | min << 4) bytes, one per 16 values, 64 bytes of 2-bit
    quants (value 128h + 32i + l: bits 2i, 2i+1 of qs[32h + l]), f16 d, f16
    dmin: ``d*sc*q - dmin*m``."""

    def factors(self, blk: _Block) -> None:
        """Buffer lanes 0-15: ``d*sc[s]``; lanes 16-31: ``dmin*m[s]``."""
        def make():
            b = self.kb.b
            s = blk.bytes(self.at("scales"), 16)
            dd = blk.f16s(self.at("d"), 2)   # d, dmin
            d, dmin = (self.kb.splat(b.extract_element(dd, i64(i)), 16) for i in (0, 1))
            self.store_factors(b.fmul(d, self.widen(b.and_(s, i8s(16, 15)))))
            self.store_factors(b.fmul(dmin, self.widen(b.lshr(s, i8s(16, 4)))), 16)
        blk.once("factors", make)

    def piece(self, blk, io, w):
        b = self.kb.b
        h, r = divmod(io, 128)
        i, l0 = divmod(r, 32)
        q = b.and_(_shift_bits(b, blk.bytes(self.at("qs") + 32 * h + l0, w), -2 * i), i8s(w, 3))
        self.factors(blk)
        f = self.factor(blk, io // 16, w)
        m = b.fneg(self.factor(blk, 16 + io // 16, w))
        return self.kb.mul_add(self.widen(q), f, m)


class Q3KDecoder(KQuantDecoder):
    """32 bytes of high bits (bit 4h + i of hmask[l] for value 128h + 32i +
    l), 64 bytes of 2-bit low parts (as Q2_K's), 12 bytes of packed 6-bit
    scales, f16 d: ``d*(sc - 32)*q`` with q = low + 4 hbit - zero (4)."""

    def piece(self, blk, io, w):
        b = self.kb.b
        h, r = divmod(io, 128)
        i, l0 = divmod(r, 32)
        low = b.and_(_shift_bits(b, blk.bytes(self.at("qs") + 32 * h + l0, w), -2 * i), i8s(w, 3))
        hb = b.and_(_shift_bits(b, blk.bytes(self.at("hmask") + l0, w), 2 - (4 * h + i)), i8s(w, 4))   # bit 4h+i -> bit 2
        q = b.sub(b.or_(low, hb), i8s(w, self.qt.zero))

        def factors():  # d * (sc - 32) for the 16 sub-blocks
            sc = b.sitofp(q3k_scales(b, blk.bytes(q3k_scales_at(self.qt), 16)), self.kb.vtype(16))
            d = self.kb.splat(b.extract_element(blk.f16s(self.at("d"), 1), i64(0)), 16)
            self.store_factors(b.fmul(d, sc))
        blk.once("factors", factors)
        return b.fmul(self.widen(q, signed=True), self.factor(blk, io // 16, w))
