"""The integer path of ``qmatmul`` (``act="q8"``) on QSF's block types
(QSF_Q8, QSF_Q4, QSF_Q2, QSF_Q2S, QSF_TERNARY; bytes: ``ir/quant/qsf.py``).

The numbers are ``ir.ops.qmatmul_ref``'s: a 64-value weight block is two
32-value blocks of the q8 activation sharing its d and offset
(``ir.int_dot``). So this is ``int_q8``'s kernel (quantization,
slots, tiles, ``decode_rows`` batches, the prompt-chunk GEMM and its
fallback, all reused) with hooks that find a 32-value half of a block and
make its quants unsigned for ``vpdpbusd``:

    QSF_Q8        q + 128 (xor 0x80), bias 128 (the int32 seed -128 sum(q_x))
    QSF_Q4        the nibble q, 0..15: (q - z) d = d q + m_w, m_w = -z d
    QSF_Q2        the crumb q, 0..3:    d q + m
    QSF_Q2S       the crumb q, 0..3:    (q - 1.5) d = d q + m_w, m_w = -1.5 d

The offset types take the offset layouts' second FMA (m_w times the slot's
d_x sum(q_x)); m_w is exact in float32 (products of two float16s).

Block j (32 values) is half j & 1 of stored block j >> 1. Where a group
holds two blocks (vector width 16: G = 2 and the row's block count is even,
K being a multiple of 64) j is even and the group is one whole stored
block, its halves at static offsets (QSF_Q8's 64 quants are one load); at
G = 1 the half is a run-time value (a byte offset, or a shift of 4 h bits).

QSF_TERNARY without multiplies
------------------------------
value j = d t_j, t_j = 0 where bit j of ``zero`` is set, else -1 where bit
j of ``sign`` is, else +1. So the block's integer dot is
sum_{t=+1} q_x - sum_{t=-1} q_x, and the kernel adds bytes instead of
multiplying them: the two 32-bit halves of the masks (64 bits for a whole
block) become ``<n x i1>`` masks, pos = ~zero & ~sign, neg = ~zero & sign;

    s = select(neg, -q_x, select(pos, q_x, 0))          (AVX-512BW: masked moves)

is t q_x byte by byte (q_x is in -127..127, so -q_x is an int8). The bytes
are summed by ``vpsadbw`` against zero, which adds 8 unsigned bytes into
each 64-bit lane: on s ^ 0x80 = s + 128 each lane is its 8 values' sum +
1024, a constant (zero weights give 0x80 too, so no popcount correction is
needed), subtracted through the block's int32 lanes. The lanes of a block
then sum to its exact integer dot, and the float epilogue is the symmetric
layouts' (one FMA by d_w d_x). Without ``vpsadbw`` (not x86, or the
portable path): sign-extend s to int32 and add pairs, no multiply either.

Prompt chunks: the GEMM (``gemm``) unpacks each row's 32
unsigned bytes from ``unsigned_block``; ternary's there are t + 1 (0..2,
bias 1), where ``vpdpbusd`` does 4 weight rows' products per byte quad
(a GEMM's weight bytes are reused by every token, so there the multiply is
the cheap part). Without VNNI or where the rows do not fill its tiles,
prompt chunks run this decode kernel ``_GEMM_FALLBACK_ROWS`` rows at a
time, as for GGUF.

QSF weights are never repacked (``passes/repack`` knows only GGUF layouts).
"""
from __future__ import annotations

import llvmlite.ir as ir

from ..emit import F32, I32, KernelBuilder, i64
from ..kernels import KernelSig
from ..simd import I1, I8, I64, call, gather_f16, psadbw, shuffle, vconst
from .int_q8 import QK, IntKernel, fold_pairs

#: vpsadbw of each 32 bytes: 4 lanes of 8 bytes, each + 8 * 128
_SAD_BIAS = 8 * 128


class QSFIntKernel(IntKernel):
    """``int_q8``'s kernel on QSF blocks (module docstring)."""

    def __init__(self, kb: KernelBuilder, sig: KernelSig, qt) -> None:
        super().__init__(kb, sig, qt)
        layout = qt.name
        if self.nb % 2:
            raise NotImplementedError(f"row length {self.k} is not a multiple of 64")
        self.bytes_per_block = self.bb // 2
        self.ternary = layout == "QSF_TERNARY"

    # --- where a 32-value block lives --------------------------------------------------------
    def block_ptr(self, row: ir.Value, j: ir.Value) -> ir.Value:
        """The stored block holding 32-value block j of the row (nb is even)."""
        b = self.b
        at = b.ashr(b.add(b.mul(row, i64(self.nb)), j), i64(1))
        return self.kb.gep(self.w, b.mul(at, i64(self.bb)))

    def _crumb_pairs(self, v: ir.Value) -> list[ir.Value]:
        """16 bytes -> their 2-bit fields 0..3 (4 vectors of 16 values each, in value order)."""
        b, n = self.b, v.type.count
        return [b.and_(b.lshr(v, vconst(I8, [2 * k] * n)) if k else v, vconst(I8, [3] * n)) for k in range(4)]

    def unsigned_block(self, bp: ir.Value, j: ir.Value) -> ir.Value:
        """<32 x i8>: half j & 1 of the block at bp, plus the bias (ternary: t + 1)."""
        kb, b = self.kb, self.b
        h = b.and_(j, i64(1))
        if self.ternary:
            sign, zero = (self._mask_bits(bp, self.qt.at(f), h) for f in ("sign", "zero"))
            t1 = b.select(sign, vconst(I8, [0] * QK), vconst(I8, [2] * QK))
            return b.select(zero, vconst(I8, [1] * QK), t1)
        at = self.qt.at("qs")
        if self.layout == "QSF_Q8":
            return b.xor(kb.vload(kb.gep(bp, b.add(i64(at), b.mul(h, i64(QK)))), 0, QK), vconst(I8, [0x80] * QK))
        if self.layout == "QSF_Q4":       # low nibbles are values 0..31, high 32..63
            v = kb.vload(bp, at, QK)
            sh = kb.splat(b.trunc(b.mul(h, i64(4)), I8), QK)
            return b.and_(b.lshr(v, sh), vconst(I8, [0x0F] * QK))
        # 2-bit: values 32h .. 32h+31 are fields 2h and 2h+1 of the 16 bytes
        v = kb.vload(bp, at, 16)
        v = b.lshr(v, kb.splat(b.trunc(b.mul(h, i64(4)), I8), 16))
        lo, hi = self._crumb_pairs(v)[:2]
        return shuffle(kb.b, lo, hi, list(range(QK)))

    def _whole_block(self, bp: ir.Value) -> ir.Value:
        """<64 x i8>: both halves of the block at bp, unsigned (not ternary)."""
        kb, b = self.kb, self.b
        at = self.qt.at("qs")
        if self.layout == "QSF_Q8":
            return b.xor(kb.vload(bp, at, 2 * QK), vconst(I8, [0x80] * 2 * QK))
        if self.layout == "QSF_Q4":
            v = kb.vload(bp, at, QK)
            return shuffle(kb.b, b.and_(v, vconst(I8, [0x0F] * QK)), b.lshr(v, vconst(I8, [4] * QK)), list(range(64)))
        c = self._crumb_pairs(kb.vload(bp, at, 16))
        return shuffle(kb.b, shuffle(kb.b, c[0], c[1], list(range(32))), shuffle(kb.b, c[2], c[3], list(range(32))),
                        list(range(64)))

    def _mask_bits(self, bp: ir.Value, at: int, h: ir.Value | None) -> ir.Value:
        """The ternary mask at byte ``at``: bits 32h .. 32h+31 as <32 x i1>, or
        (h None) all 64 as <64 x i1>."""
        kb, b = self.kb, self.b
        if h is None:
            word = b.load(b.bitcast(kb.gep(bp, at), ir.PointerType(I64)), align=1)
            return b.bitcast(word, ir.VectorType(I1, 64))
        p = kb.gep(bp, b.add(i64(at), b.mul(h, i64(4))))
        return b.bitcast(b.load(b.bitcast(p, ir.PointerType(I32)), align=1), ir.VectorType(I1, QK))

    def group_quants(self, row: ir.Value, j: ir.Value, g: int) -> tuple[ir.Value, list[ir.Value]]:
        """g = 2: j is even (module docstring), the group is one stored
        block. Ternary: the (pos, neg) masks, for ``_dot``."""
        bp = self.block_ptr(row, j)
        if not self.ternary:
            return (self.unsigned_block(bp, j) if g == 1 else self._whole_block(bp)), [bp] * g
        b = self.b
        h = b.and_(j, i64(1)) if g == 1 else None
        sign, zero = (self._mask_bits(bp, self.qt.at(f), h) for f in ("sign", "zero"))
        nonzero = b.not_(zero)
        return (b.and_(nonzero, b.not_(sign)), b.and_(nonzero, sign)), [bp] * g

    def block_scales(self, bps: list[ir.Value], js: list[ir.Value]) -> tuple[ir.Value, ir.Value | None]:
        """d_w of each block and, for the offset types, m_w computed from its fields."""
        kb, b = self.kb, self.b
        d = gather_f16(kb, bps, self.qt.at("d"))
        n = len(bps)
        if self.layout == "QSF_Q2":
            return d, gather_f16(kb, bps, self.qt.at("m"))
        if self.layout == "QSF_Q4":       # -z * d: exact (two float16 significands)
            return d, b.fmul(b.fneg(gather_f16(kb, bps, self.qt.at("z"))), d)
        if self.layout == "QSF_Q2S":      # -1.5 * d: exact
            return d, b.fmul(vconst(F32, [-1.5] * n), d)
        return d, None

    # --- ternary: sums of selected activation bytes ------------------------------------------------
    def dot(self, u, xq: ir.Value, init: ir.Value, g: int) -> ir.Value:
        if not self.ternary:
            return super().dot(u, xq, init, g)
        kb, b = self.kb, self.b
        pos, neg = u
        n = QK * g
        zero = vconst(I8, [0] * n)
        s = b.select(neg, b.sub(zero, xq), b.select(pos, xq, zero))     # t * q_x, no multiply
        name = psadbw(kb.target, g)
        if name:
            sad = call(kb, name, ir.VectorType(I64, 4 * g), [b.xor(s, vconst(I8, [0x80] * n)), zero])
            lanes = b.add(b.bitcast(sad, ir.VectorType(I32, 8 * g)), vconst(I32, [-_SAD_BIAS, 0] * 4 * g))
        else:
            s32 = b.sext(s, ir.VectorType(I32, n))
            ev = shuffle(kb.b, s32, s32, list(range(0, n, 2)))
            od = shuffle(kb.b, s32, s32, list(range(1, n, 2)))
            lanes = fold_pairs(kb, b.add(ev, od))
        return lanes   # the slot's int32 seed (-sum q_x, for the GEMM's t + 1) is not this sum's
