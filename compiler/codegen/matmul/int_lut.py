"""The integer path of ``qmatmul`` (``act="q8"``) on GGUF's table types
(IQ4_NL, IQ4_XS, MXFP4; bytes: ``ir/quant/lut.py``), as llama.cpp's
``ggml_vec_dot_iq4_nl_q8_0`` and ``ggml_vec_dot_mxfp4_q8_0``.

The numbers are ``ir.int_dot``'s: the weight's integer quants are the
table values K[i] (int8), its scale d_w per 32 values is d (IQ4_NL),
2^(e - 128) (MXFP4) or d * (ls - 32) of the sub-block (IQ4_XS, each of its
eight 32-value sub-blocks one integer block, exact in float32). So this is
``int_q8``'s kernel (quantization, slots, tiles, ``decode_rows`` batches,
the prompt-chunk GEMM and its fallback) with hooks that turn a block's
nibbles into unsigned bytes for ``vpdpbusd``: one byte lookup
(``simd.lookup16``: ``vpshufb``, 64 bytes at once at vector width 16) in
the type's table plus the row's zero point (``K[i] + 128``, 1..241), whose
bias comes back through the int32 seed -128 sum(q_x) as for Q8_0.

IQ4_XS: 32-value block j is sub-block j % 8 of stored block j / 8 (K is a
multiple of 256). At vector width 16 a group is two sub-blocks 2s, 2s + 1,
whose 32 quant bytes are one load; ``block_scales`` makes each block's
d * (ls - 32) from the packed scale bits with the block's index.
"""
from __future__ import annotations

import llvmlite.ir as ir

from ..emit import F32, I32, KernelBuilder, i64
from ..kernels import KernelSig
from ..simd import I8, I16, gather_f16, lookup16, shuffle, vconst
from .int_q8 import QK, IntKernel

#: nibble index vector of one 32-value block from its 16 bytes (low nibbles, then high)
_BLOCK = list(range(32))
#: two consecutive 32-value blocks from 32 bytes: lows 0-15, highs 0-15, lows 16-31, highs 16-31
_PAIR = list(range(16)) + list(range(32, 48)) + list(range(16, 32)) + list(range(48, 64))


class LUTIntKernel(IntKernel):
    """IQ4_NL (MXFP4 and IQ4_XS below): one 32-value block per stored block, float16 d."""

    def __init__(self, kb: KernelBuilder, sig: KernelSig, qt) -> None:
        super().__init__(kb, sig, qt)
        #: the unsigned byte of each index: table value + the type's zero point
        self.table = [v + qt.zero for v in qt.layout.kvalues]
        assert all(0 <= v <= 255 for v in self.table), self.table

    def indices(self, qs: ir.Value, order: list[int]) -> ir.Value:
        """Nibble indices (<2n x i8>, in ``order``) of the n quant bytes ``qs``."""
        b, n = self.b, qs.type.count
        return shuffle(b, b.and_(qs, vconst(I8, [0x0F] * n)), b.lshr(qs, vconst(I8, [4] * n)), order)

    def unsigned_block(self, bp: ir.Value, j: ir.Value) -> ir.Value:
        return lookup16(self.kb, self.table, self.indices(self.kb.vload(bp, self.qt.at("qs"), 16), _BLOCK))

    def group_quants(self, row: ir.Value, j: ir.Value, g: int) -> tuple[ir.Value, list[ir.Value]]:
        """The g blocks' indices side by side, then one lookup for all."""
        b = self.b
        bps = [self.block_ptr(row, b.add(j, i64(i))) for i in range(g)]
        idx = [self.indices(self.kb.vload(bp, self.qt.at("qs"), 16), _BLOCK) for bp in bps]
        both = idx[0] if g == 1 else shuffle(b, idx[0], idx[1], list(range(64)))
        return lookup16(self.kb, self.table, both), bps


class MXFP4IntKernel(LUTIntKernel):
    """d_w = 2^(e - 128) from each block's exponent byte."""

    def block_scales(self, bps, js):
        b, n = self.b, len(bps)
        v = ir.VectorType(I32, n)
        e = ir.Constant(v, ir.Undefined)
        for i, bp in enumerate(bps):
            e = b.insert_element(e, b.zext(b.load(self.kb.gep(bp, self.qt.at("e"))), I32), i64(i))
        c = lambda x: vconst(I32, [x] * n)  # noqa: E731
        small = b.shl(c(0x00200000), b.and_(e, c(1)))              # e < 2: a subnormal
        bits = b.select(b.icmp_unsigned("<", e, c(2)), small, b.shl(b.sub(e, c(1)), c(23)))
        return b.bitcast(bits, ir.VectorType(F32, n)), None


class IQ4XSIntKernel(LUTIntKernel):
    """Eight 32-value blocks per stored block (module docstring)."""

    def __init__(self, kb: KernelBuilder, sig: KernelSig, qt) -> None:
        super().__init__(kb, sig, qt)
        self.per = qt.block // QK
        self.sub = qt.sub_block
        assert self.sub == QK and self.nb % self.per == 0, (qt, self.k)
        self.bytes_per_block = self.bb // self.per

    def block_ptr(self, row: ir.Value, j: ir.Value) -> ir.Value:
        """The stored block holding 32-value block j of the row."""
        b = self.b
        at = b.lshr(b.add(b.mul(row, i64(self.nb)), j), i64(self.per.bit_length() - 1))
        return self.kb.gep(self.w, b.mul(at, i64(self.bb)))

    def _quant_bytes(self, bp: ir.Value, j: ir.Value, n: int) -> ir.Value:
        """The n quant bytes from sub-block j % 8 on."""
        b = self.b
        at = b.add(i64(self.qt.at("qs")), b.mul(b.and_(j, i64(self.per - 1)), i64(16)))
        return self.kb.vload(self.kb.gep(bp, at), 0, n)

    def unsigned_block(self, bp, j):
        return lookup16(self.kb, self.table, self.indices(self._quant_bytes(bp, j, 16), _BLOCK))

    def group_quants(self, row, j, g):
        """g = 2: j is even, sub-blocks j % 8 and the next, one 32-byte load."""
        bp = self.block_ptr(row, j)
        if g == 1:
            return self.unsigned_block(bp, j), [bp]
        return lookup16(self.kb, self.table, self.indices(self._quant_bytes(bp, j, 32), _PAIR)), [bp] * g

    def block_scales(self, bps, js):
        """d * (ls - 32) of sub-block j % 8 of each block (exact in float32)."""
        kb, b, n = self.kb, self.b, len(bps)
        v = ir.VectorType(I32, n)
        lo = hi = sub = ir.Constant(v, ir.Undefined)
        for i, (bp, j) in enumerate(zip(bps, js)):
            lo = b.insert_element(lo, b.load(b.bitcast(kb.gep(bp, self.qt.at("scales_l")), ir.PointerType(I32)),
                                             align=1), i64(i))
            h = b.load(b.bitcast(kb.gep(bp, self.qt.at("scales_h")), ir.PointerType(I16)), align=1)
            hi = b.insert_element(hi, b.zext(h, I32), i64(i))
            sub = b.insert_element(sub, b.trunc(b.and_(j, i64(self.per - 1)), I32), i64(i))
        c = lambda x: vconst(I32, [x] * n)  # noqa: E731
        lo = b.and_(b.lshr(lo, b.shl(sub, c(2))), c(15))            # nibble s of scales_l
        hi = b.and_(b.lshr(hi, b.shl(sub, c(1))), c(3))             # bits 2s, 2s + 1 of scales_h
        ls = b.sub(b.or_(lo, b.shl(hi, c(4))), c(32))
        d = gather_f16(kb, bps, self.qt.at("d"))
        return b.fmul(d, b.sitofp(ls, ir.VectorType(F32, n))), None

