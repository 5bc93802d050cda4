"""Kernels of GGUF's ternary types TQ1_0 and TQ2_0 (bytes and value order:
``ir/quant/ternary.py``): a super-block of 256 codes c in 0..2 and one
float16 d, value (c - 1) d.

Decoding the codes
------------------
* TQ2_0: 2-bit fields, a shift by 2l and a mask.
* TQ1_0: digit n of byte b is ((b 3^n) mod 256) 3 >> 8, which is
  [p >= 86] + [p >= 171] for p = (b 3^n) mod 256: a product of bytes by
  a constant (x86 has no byte multiply; LLVM makes each power from b
  itself, 3b with two adds, the others with GFNI or a ``vpmaddubsw`` /
  ``vpmullw`` pair) and two unsigned byte compares. No product ever
  involves an activation.

Float path (``TQ1Decoder``, ``TQ2Decoder``: matmul, qmatmul, embedding)
-----------------------------------------------------------------------
``GGUFBlockDecoder``s with 256-value blocks: a decode call is one
super-block, every vector piece lies in one run of bytes at a static
offset (TQ1_0's 16 qh values: one 4-byte load spread over the lanes,
each lane with its own power of 3). A piece is its codes made the float
t = c - 1 (TQ1_0: a select of -1, 0, +1 by the compares); the loop
multiplies by d (in a matvec, the block's partial dot product once: the
deferred scale), so the weights are ``float(c - 1) * d`` as ggml rounds
them, the sign of a zero included.

Integer path (``TQ1Int``, ``TQ2Int``: ``act="q8k"``)
----------------------------------------------------
As llama.cpp's ``ggml_vec_dot_tq1_0_q8_K`` / ``_tq2_0_q8_K``: x quantized
per 256 values (Q8_K), per super-block d_w d_x (sum of (c - 1) q_x). That
is the K-quant kernel (``int_kquants``: slots, quantization, tiles,
batches of decode rows bit for bit, the prompt GEMM ``gemm_kquants``)
with one sub-block of 256 values of scale 1 and the zero point 1: the
codes are the unsigned quants, and -sum(q_x) (the 16 partial sums of x
times -1) seeds the int32 sum. Why q8k and not q8 (32-value activation
blocks sharing d): llama.cpp's numbers; one convert and FMA per 256
values instead of 8; and the kernel works a super-block at a time, so
TQ1_0's irregular runs (5 digits of 32 bytes, 5 of 16, 4 of 4) are known
when the kernel is generated, where the q8 kernel would see a 32-value
block whose place in its super-block is a run-time value.

* TQ2_0's runs are Q2_K's (one shift of 64 bytes gives runs i and 4 + i).
* TQ1_0: the 32 + 16 qs bytes and the 4 qh bytes (at lanes 48 + 4n + j)
  are one 64-byte vector X, whose five digit vectors D_n (of X 3^n) are
  made once per super-block and row; each run of 32 values is a shuffle
  of them (run r < 5: D_r's first 32 bytes; runs 5, 6: D_n's and
  D_n+1's bytes 32..47; run 7: D_4's bytes 32..47 and the qh digits).

Products: with VNNI one ``vpdpbusd`` of the codes 0..2 by x's bytes per
64 (32) values and row. Without it the K-quants' portable form
(``pmaddubsw`` / ``pmaddwd`` by the scale 1, or widening multiplies):
exact, the same integers. (QSF_TERNARY's masked byte sums, ``int_qsf``,
pay where the stored bits are the masks; here masks would be compares of
the codes, then per activation row two masked moves, an xor, a
``vpsadbw`` and a bias per 32 values, against one ``vpdpbusd`` per 64.)

No repacked form: a decode step reads 1.7 (TQ1_0) or 2.1 (TQ2_0) bits
per weight, and the row-major kernel's unpacking is a few byte
operations per 32 values.
"""
from __future__ import annotations

import llvmlite.ir as ir

from ..emit import F32
from ..simd import I8, I16, call, dpbusd, gather_f16, shuffle, vconst
from .decode_gguf import Block, GGUFBlockDecoder
from .int_kquants import KQuantIntKernel, KScales

#: p = (b 3^n) mod 256 has digit [p >= _ONE] + [p >= _TWO] (3p >> 8)
_ONE, _TWO = 86, 171
#: values of TQ1_0's qs[0..31] part (5 digits of 32 bytes) and of its qs[32..47] part
_QS0, _QS1 = 160, 240


def times_pow3(b: ir.IRBuilder, v: ir.Value, exps: list[int]) -> ir.Value:
    """<n x i8>: lane i of v times 3^exps[i], mod 256 (ggml's uint8 product).
    x86 has no byte multiply: LLVM makes a product by these constants
    of adds (3v = v + v + v), GFNI or ``vpmaddubsw`` / ``vpmullw`` pairs,
    each power from v itself (no chain of triplings)."""
    if not any(exps):
        return v
    return b.mul(v, vconst(I8, [3 ** e % 256 for e in exps]))


def digit_masks(b: ir.IRBuilder, p: ir.Value) -> tuple[ir.Value, ir.Value]:
    """(digit >= 1, digit == 2) of the bytes p = (b 3^n) mod 256: two unsigned compares."""
    n = p.type.count
    return (b.icmp_unsigned(">=", p, vconst(I8, [_ONE] * n)), b.icmp_unsigned(">=", p, vconst(I8, [_TWO] * n)))


def digits(b: ir.IRBuilder, p: ir.Value) -> ir.Value:
    """<n x i8>: the base-3 digit (0..2) of each byte p = (b 3^n) mod 256."""
    ge1, ge2 = digit_masks(b, p)
    t = ge1.type.count
    return b.add(b.zext(ge1, ir.VectorType(I8, t)), b.zext(ge2, ir.VectorType(I8, t)))


# --- the float path ------------------------------------------------------------------------------
class TQ1Decoder(GGUFBlockDecoder):
    """TQ1_0's pieces as t = digit - 1 in float (the loop scales them by d)."""

    def _source(self, blk: Block, o: int, w: int) -> tuple[ir.Value, list[int]]:
        """The bytes of values o .. o+w-1 in lane order, and each lane's digit."""
        kb, b = self.kb, self.kb.b
        qs, qh = self.qt.at("qs"), self.qt.at("qh")
        if o < _QS0:
            n, m = divmod(o, 32)
            assert m + w <= 32, (o, w)
            return kb.vload(blk.bp, qs + m, w), [n] * w
        if o < _QS1:
            n, m = divmod(o - _QS0, 16)
            assert m + w <= 16, (o, w)
            return kb.vload(blk.bp, qs + 32 + m, w), [n] * w
        lanes = [o - _QS1 + i for i in range(w)]
        assert lanes[-1] < 16, (o, w)
        if "qh" not in blk.cache:
            blk.cache["qh"] = kb.vload(blk.bp, qh, 4)
        h = blk.cache["qh"]
        src = h if lanes == [0, 1, 2, 3] else shuffle(b, h, None, [v % 4 for v in lanes])
        return src, [v // 4 for v in lanes]

    def quants(self, blk, o, w):
        b, kb = self.kb.b, self.kb
        src, exps = self._source(blk, o, w)
        ge1, ge2 = digit_masks(b, times_pow3(b, src, exps))
        return b.select(ge2, vconst(F32, [1.0] * w), b.select(ge1, kb.vzero(w), vconst(F32, [-1.0] * w)))


class TQ2Decoder(GGUFBlockDecoder):
    """TQ2_0's pieces: bits 2l, 2l+1 of 32 bytes, minus 1, converted (the loop scales them by d)."""

    def quants(self, blk, o, w):
        b = self.kb.b
        h, r = divmod(o, 128)
        l, m = divmod(r, 32)
        assert m + w <= 32, (o, w)
        v = self.kb.vload(blk.bp, self.qt.at("qs") + 32 * h + m, w)
        if l:
            v = b.lshr(v, vconst(I8, [2 * l] * w))
        if l < 3:
            v = b.and_(v, vconst(I8, [3] * w))
        return b.sitofp(b.sub(v, vconst(I8, [self.qt.zero] * w)), self.kb.vtype(w))


# --- the integer path ----------------------------------------------------------------------------
class _TernaryInt(KQuantIntKernel):
    """One sub-block of 256 values, scale 1, no minimum; the zero point (1)
    comes back through the K-quant kernel's offset seed. Subclasses give ``run``."""

    def scales(self, bp):
        d = gather_f16(self.kb, [bp], self.at("d"))
        return KScales(vconst(I16, [1]), None, shuffle(self.b, d, vconst(F32, [0.0]), [0, 1]))   # (d, -dmin = 0)

    def chunk_dot(self, s, u, xq, sc):
        """``vpdpbusd`` where the target has it (the scale is 1), else the K-quants' form."""
        name = dpbusd(self.kb.target, self.CH // 32)
        if name is None:
            return super().chunk_dot(s, u, xq, sc)
        return call(self.kb, name, s.type, [s, u, xq])


class TQ2Int(_TernaryInt):
    """64 bytes of 2-bit codes: run 4h + i is bits 2i, 2i+1 of bytes 32h .. 32h+31."""

    runs_64 = [(0, 4), (1, 5), (2, 6), (3, 7)]     # as Q2_K's: one shift of 64 bytes gives runs i and 4 + i

    def run(self, bp, r):
        h, i = divmod(r, 4)
        return self._bits(self._bytes(bp, self.at("qs") + 32 * h), 2 * i, 3)


class TQ1Int(_TernaryInt):
    """Base-3 digits: every run a shuffle of the five digit vectors of one
    64-byte vector of the block (module docstring)."""

    runs_64 = [(0, 1), (2, 3), (4, 5), (6, 7)]

    def __init__(self, kb, sig, qt) -> None:
        super().__init__(kb, sig, qt)
        #: block address -> (it, its eight runs): each row's block is decoded once
        #: however its runs are asked for (the GEMM asks run by run across rows)
        self._decoded: dict[int, tuple[ir.Value, list[ir.Value]]] = {}

    def run(self, bp, r):
        got = self._decoded.get(id(bp))
        if got is None or got[0] is not bp:
            got = bp, self._runs(bp)
            self._decoded[id(bp)] = got
        return got[1][r]

    def _runs(self, bp: ir.Value) -> list[ir.Value]:
        b = self.b
        qs, qh = self.at("qs"), self.at("qh")
        low = self._bytes(bp, qs, 32)                                        # values 32n + m
        mid = self._bytes(bp, qs + 32, 16)                                   # values 160 + 16n + m
        h4 = self.kb.vload(bp, qh, 4)                                        # values 240 + 4n + j
        high = shuffle(b, mid, shuffle(b, h4, None, [j % 4 for j in range(16)]), list(range(32)))
        x = shuffle(b, low, high, list(range(64)))
        d = [digits(b, times_pow3(b, x, [n] * 64)) for n in range(5)]
        runs = [shuffle(b, d[n], None, list(range(32))) for n in range(5)]
        both = list(range(32, 48)) + list(range(64 + 32, 64 + 48))          # digits n, n+1 of qs[32..47]
        runs += [shuffle(b, d[0], d[1], both), shuffle(b, d[2], d[3], both)]
        qh01 = shuffle(b, d[0], d[1], list(range(48, 52)) + list(range(64 + 52, 64 + 56)))
        qh23 = shuffle(b, d[2], d[3], list(range(56, 60)) + list(range(64 + 60, 64 + 64)))
        qhd = shuffle(b, qh01, qh23, list(range(16)))
        runs.append(shuffle(b, shuffle(b, d[4], None, list(range(32, 48))), qhd, list(range(32))))
        return runs

