"""The prompt-chunk GEMM (``k_matmul_int_gemm``) on the K-quants Q4_K,
Q5_K, Q6_K, with the q8k numbers (``ir.int_kquants.qmatmul_q8k_ref``).

Why q8k and not q8 (per-32 activations): the reference, the interpreter
and the fallback kernel (the decode path, for tiles that do not fit) stay
what they are, and Q6_K's 16-value sub-blocks would need two scales per
32-value activation block anyway. The GEMM only reorders the float sums.

Per super-block and W-row tile the unpack stores the 256 unsigned quants
in VNNI order (per run of 32 values, 8 vectors of W rows x 4 values: the
decode kernel's runs, transposed) and 16 float vectors of W lanes: Q4_K /
Q5_K d * sc_s and -dmin * m_s per 32-value sub-block, Q6_K d * sc_s per
16 (exact products: a float16 times a 6- or 8-bit integer).

Per token and super-block (one register block of tokens sharing each
sub-block's weight vectors):

* Q4_K / Q5_K, per sub-block s: 8 ``vpdpbusd`` from zero (quants unsigned,
  no bias), then f += float(dot) * (d sc_s), f += (-dmin m_s) * bsum32_s;
* Q6_K, per 16 values: 4 ``vpdpbusd`` seeded with -32 * bsum16 (its quants
  are stored u = q + 32), then f += float(dot) * (d sc_s);

and the token's accumulator takes f * d_x (one FMA). As for the 32-value
layouts, one chain per token over the super-blocks in order, whatever T.
"""
from __future__ import annotations

import llvmlite.ir as ir

from .emit import F32, I32, KernelBuilder, i64
from .k_matmul_int_gemm import GemmBase, gemm_width, transpose
from .k_matmul_int_kquants import QK_K, RUN, quantize_q8k_block
from .kernels import KernelSig

I8 = ir.IntType(8)
#: super-blocks per K chunk (an unpacked super-block is 5 KB at W = 16)
KC_K = 4


def act_slot_bytes(k: int) -> int:
    """One quantized token row: K quants, per super-block 16 four-byte
    corrections (Q4_K / Q5_K: 8 float bsum32; Q6_K: 16 int32 -32 bsum16)
    and d_x, rounded up to a cache line."""
    return (k + 68 * (k // QK_K) + 63) // 64 * 64


def block_bytes(w: int) -> int:
    """One unpacked super-block of a W-row tile: 64 vectors of W x 4 bytes, 16 float vectors."""
    return 256 * w + 64 * w


def _vc(t: ir.Type, values: list) -> ir.Constant:
    return ir.Constant(ir.VectorType(t, len(values)), values)


def _shuffle(b: ir.IRBuilder, x: ir.Value, idx: list[int]) -> ir.Value:
    return b.shuffle_vector(x, ir.Constant(x.type, ir.Undefined), _vc(I32, idx))


class KQGemm(GemmBase):
    """Q4_K, Q5_K, Q6_K: scratch, quantization, unpacking, microkernel."""

    def __init__(self, kb: KernelBuilder, sig: KernelSig, kern) -> None:
        super().__init__(kb, sig, kern, act_slot_bytes(kern.k), block_bytes(gemm_width(kb.vw)), KC_K)
        self.minimums = kern.layout != "Q6_K"

    def quantize(self, xrow: ir.Value, s: ir.Value) -> None:
        kb, b = self.kb, self.b
        sp = self.slot(s)
        cor = kb.gep(sp, self.k)
        dxp = b.bitcast(kb.gep(sp, self.k + 64 * self.nb), ir.PointerType(F32))
        with kb.loop(0, self.nb, name="gq") as j:
            q, d, v = quantize_q8k_block(kb, b.add(xrow, b.mul(j, i64(QK_K))))
            kb.vstore(q, sp, b.mul(j, i64(QK_K)))
            at = kb.gep(cor, b.mul(j, i64(64)))
            if self.minimums:
                s32 = b.add(_shuffle(b, v, list(range(0, 16, 2))), _shuffle(b, v, list(range(1, 16, 2))))
                kb.vstore(b.sitofp(s32, ir.VectorType(F32, 8)), b.bitcast(at, ir.PointerType(F32)), 0)
            else:
                c = b.mul(b.sext(v, ir.VectorType(I32, 16)), _vc(I32, [-32] * 16))
                kb.vstore(c, b.bitcast(at, ir.PointerType(I32)), 0)
            kb.store(d, dxp, j)

    def unpack(self, r0: ir.Value, j: ir.Value, dst: ir.Value) -> None:
        kb, b, kern, W = self.kb, self.b, self.kern, self.W
        ptrs = [kern._block_ptr(b.add(r0, i64(r)), j) for r in range(W)]
        for run in range(QK_K // RUN):
            rows = [b.bitcast(kern._run(p, run), ir.VectorType(I32, 8)) for p in ptrs]
            for i, v in enumerate(transpose(b, rows)):
                kb.vstore(b.bitcast(v, ir.VectorType(I8, 4 * W)), dst, 4 * W * (8 * run + i))
        fs = []
        for p in ptrs:
            sc, f2 = kern.scales(p)
            f = b.fmul(b.sitofp(sc, ir.VectorType(F32, 16)), _shuffle(b, f2, [0] * 8 + [0 if not self.minimums else 1] * 8))
            fs.append(b.bitcast(f, ir.VectorType(I32, 16)))
        for c0 in range(0, 16, W):
            cols = [_shuffle(b, f, list(range(c0, c0 + W))) for f in fs] if W < 16 else fs
            for i, v in enumerate(transpose(b, cols)):
                kb.vstore(v, b.bitcast(kb.gep(dst, 256 * W + 4 * W * (c0 + i)), ir.PointerType(v.type)), 0)

    def block(self, j: ir.Value, tb: ir.Value, slots: list[ir.Value], accs: list[ir.Value]) -> list[ir.Value]:
        kb, b, W = self.kb, self.b, self.W
        zero_f = ir.Constant(self.vf, [0.0] * W)
        zero_i = ir.Constant(self.vi, [0] * W)
        fsb = [zero_f] * len(slots)
        qs = [kb.gep(sp, b.mul(j, i64(QK_K))) for sp in slots]
        cors = [kb.gep(sp, b.add(i64(self.k), b.mul(j, i64(64)))) for sp in slots]
        n_sub, per = (8, 32) if self.minimums else (16, 16)
        for s in range(n_sub):
            ws = [kb.vload(tb, 4 * W * (per // 4 * s + i), 4 * W) for i in range(per // 4)]
            scv = self.vec(tb, 256 * W + 4 * W * s)
            mv = self.vec(tb, 256 * W + 4 * W * (8 + s)) if self.minimums else None
            for p in range(len(slots)):
                seed = zero_i if self.minimums else self.bcast(kb.gep(cors[p], 4 * s), I32)
                a = self.dots(seed, ws, kb.gep(qs[p], per * s))
                f = kb.fma(b.sitofp(a, self.vf), scv, fsb[p])
                if mv is not None:
                    f = kb.fma(mv, self.bcast(kb.gep(cors[p], 4 * s), F32), f)
                fsb[p] = f
        out = []
        for sp, f, acc in zip(slots, fsb, accs):
            dx = self.bcast(kb.gep(sp, b.add(i64(self.k + 64 * self.nb), b.mul(j, i64(4)))), F32)
            out.append(kb.fma(f, dx, acc))
        return out
