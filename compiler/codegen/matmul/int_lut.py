"""The integer path of ``qmatmul`` (``act="q8"``) on GGUF's table types
(IQ4_NL, MXFP4; bytes: ``ir/quant/lut.py``), as llama.cpp's
``ggml_vec_dot_iq4_nl_q8_0`` and ``ggml_vec_dot_mxfp4_q8_0``.

The numbers are ``ir.int_dot``'s: the weight's integer quants are the
table values K[i] (int8), its scale d_w per 32 values is d (IQ4_NL) or
2^(e - 128) (MXFP4). So this is
``int_q8``'s kernel (quantization, slots, tiles, ``decode_rows`` batches,
the prompt-chunk GEMM and its fallback) with hooks that turn a block's
nibbles into unsigned bytes for ``vpdpbusd``: one byte lookup
(``simd.lookup16``: ``vpshufb``, 64 bytes at once at vector width 16) in
the type's table plus the row's zero point (``K[i] + 128``, 1..241), whose
bias comes back through the int32 seed -128 sum(q_x) as for Q8_0.
"""
from __future__ import annotations

import llvmlite.ir as ir

from ..emit import F32, I32, KernelBuilder, i64
from ..kernels import KernelSig
from ..simd import I8, lookup16, shuffle, vconst
from .int_q8 import IntKernel

#: nibble index vector of one 32-value block from its 16 bytes (low nibbles, then high)
_BLOCK = list(range(32))


class LUTIntKernel(IntKernel):
    """IQ4_NL (MXFP4 below): one 32-value block per stored block, float16 d."""

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
