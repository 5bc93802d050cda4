"""The prompt-chunk GEMM (``matmul/gemm``) on the K-quants Q2_K ..
Q6_K, with the q8k numbers (``ir.int_dot.qmatmul_q8k_ref``).

Why q8k and not q8 (per-32 activations): the reference, the interpreter
and the fallback kernel (the decode path, for tiles that do not fit) stay
what they are, and the 16-value sub-blocks of Q2_K, Q3_K and Q6_K would
need two scales per 32-value activation block anyway. The GEMM only
reorders the float sums.

Per super-block and W-row tile the unpack stores the 256 unsigned quants
in VNNI order (per run of 32 values, 8 vectors of W rows x 4 values: the
decode kernel's runs, transposed) and float vectors of W lanes: d * sc_s
per sub-block s, then -dmin * m_s per sub-block for the layouts with
minimums (16 vectors for Q3_K, Q4_K, Q5_K, Q6_K; 32 for Q2_K; exact
products: a float16 times an integer of at most 8 bits).

Per token and super-block (one register block of tokens sharing each
sub-block's weight vectors), per sub-block s of ``sub`` values:

* ``sub`` / 4 ``vpdpbusd``, from zero (Q2_K, Q4_K, Q5_K: quants unsigned,
  no offset) or seeded with -offset * bsum_s (Q3_K 4, Q6_K 32: the quants
  are stored u = q + offset), then f += float(dot) * (d sc_s);
* with minimums also f += (-dmin m_s) * bsum_s;

and the token's accumulator takes f * d_x (one FMA). As for the 32-value
layouts, one chain per token over the super-blocks in order, whatever T.
"""
from __future__ import annotations

import llvmlite.ir as ir

from ir.quant import quant_type

from .. import amx
from ..act_quant import QK_K, quantize_q8k_block
from ..emit import F32, I32, KernelBuilder, i64
from ..kernels import KernelSig
from ..simd import I8, pair_sums, shuffle, vconst
from ..target import vnni_width
from .amx_tiles import layout as amx_layout
from .gemm import GemmBase, amx_row, transpose
from .int_kquants import RUN

#: super-blocks per K chunk (an unpacked super-block is 5 KB at W = 16)
KC_K = 4


def act_slot_bytes(k: int) -> int:
    """One quantized token row: K quants, per super-block 16 four-byte
    corrections (layouts with minimums: the float sum of x's quants over
    each sub-block, 8 or 16 of them; with an offset: 16 int32 -offset
    bsum16) and d_x, rounded up to a cache line."""
    return (k + 68 * (k // QK_K) + 63) // 64 * 64


def factor_vectors(layout: str) -> int:
    """Float vectors per unpacked super-block: a d sc per sub-block, and a
    -dmin m per sub-block for the layouts with minimums."""
    qt = quant_type(layout)
    return QK_K // qt.sub_block * (2 if qt.has("dmin") else 1)


def block_bytes(w: int, layout: str) -> int:
    """One unpacked super-block of a W-row tile: 64 vectors of W x 4 bytes, then the float vectors."""
    return 256 * w + 4 * w * factor_vectors(layout)


def scratch_bytes(sig: KernelSig) -> int:
    """Per-thread scratch of the K-quant GEMM (at W = 16, an upper bound for
    8), with its AMX path's (``amx_tiles.layout``)."""

    k = int(sig.in_types[1].shape[1])
    kc = min(int(sig.attr.get("kc", KC_K)), k // QK_K)
    ts = int(sig.attr["gemm"])
    used = ts * act_slot_bytes(k) + kc * block_bytes(16, sig.in_types[1].layout)
    return amx_layout(used, ts, act_slot_bytes(k), amx_panel_bytes(sig.in_types[1].layout) * (k // QK_K))[2]


def amx_panel_bytes(layout: str) -> int:
    """A super-block's AMX panel entry: 16 tokens' d_x, then per sub-block their corrections."""
    return 4 * amx.ROWS * (1 + QK_K // quant_type(layout).sub_block)


class KQGemm(GemmBase):
    """The K-quants: scratch, quantization, unpacking, microkernel; what
    differs between them is the decode kernel's (``kern``): its runs and
    scales, the sub-block size, minimums or an offset."""

    def __init__(self, kb: KernelBuilder, sig: KernelSig, kern, width: int | None = None) -> None:
        w = width or vnni_width(kb.vw, kb.target)
        super().__init__(kb, sig, kern, act_slot_bytes(kern.k), block_bytes(w, kern.layout), KC_K, width=w)
        self.minimums, self.offset, self.sub = kern.minimums, kern.offset, kern.sub
        self.n_sub = QK_K // self.sub

    def quantize(self, xrow: ir.Value, s: ir.Value) -> None:
        kb, b = self.kb, self.b
        sp = self.slot(s)
        cor = kb.gep(sp, self.k)
        dxp = b.bitcast(kb.gep(sp, self.k + 64 * self.nb), ir.PointerType(F32))
        with kb.loop(0, self.nb, name="gq") as j:
            q, d, v = quantize_q8k_block(kb, b.add(xrow, b.mul(j, i64(QK_K))), self.x)
            kb.vstore(q, sp, b.mul(j, i64(QK_K)))
            at = kb.gep(cor, b.mul(j, i64(64)))
            if self.minimums:   # x's quants summed over each sub-block
                if self.sub == 32:
                    v = b.add(shuffle(b, v, None, list(range(0, 16, 2))), shuffle(b, v, None, list(range(1, 16, 2))))
                kb.vstore(b.sitofp(v, ir.VectorType(F32, self.n_sub)), b.bitcast(at, ir.PointerType(F32)), 0)
            else:   # per sub-block, -offset times x's quants summed over it (its 16-value sums)
                c = b.mul(b.sext(v, ir.VectorType(I32, 16)), vconst(I32, [-self.offset] * 16))
                while c.type.count > self.n_sub:
                    c = pair_sums(b, c)
                kb.vstore(c, b.bitcast(at, ir.PointerType(I32)), 0)
            kb.store(d, dxp, j)

    def unpack(self, r0: ir.Value, j: ir.Value, dst: ir.Value) -> None:
        kb, b, kern, W = self.kb, self.b, self.kern, self.W
        ptrs = [kern.block_ptr(b.add(r0, i64(r)), j) for r in range(W)]
        for run in range(QK_K // RUN):
            rows = [b.bitcast(kern.run(p, run), ir.VectorType(I32, 8)) for p in ptrs]
            for i, v in enumerate(transpose(b, rows)):
                kb.vstore(b.bitcast(v, ir.VectorType(I8, 4 * W)), dst, 4 * W * (8 * run + i))
        fs = [b.bitcast(self._factors(p), ir.VectorType(I32, factor_vectors(kern.layout))) for p in ptrs]
        for c0 in range(0, fs[0].type.count, W):
            cols = [shuffle(b, f, None, list(range(c0, c0 + W))) for f in fs] if W < fs[0].type.count else fs
            for i, v in enumerate(transpose(b, cols)):
                kb.vstore(v, b.bitcast(kb.gep(dst, 256 * W + 4 * W * (c0 + i)), ir.PointerType(v.type)), 0)

    def _factors(self, p: ir.Value) -> ir.Value:
        """One row's float factors: d sc_s for every sub-block s, then -dmin m_s."""
        b, ks = self.b, self.kern.scales(p)
        vf = ir.VectorType(F32, self.n_sub)
        f = b.fmul(b.sitofp(ks.sc, vf), shuffle(b, ks.f2, None, [0] * self.n_sub))
        if ks.m is None:
            return f
        m = b.fmul(b.sitofp(ks.m, vf), shuffle(b, ks.f2, None, [1] * self.n_sub))
        return b.shuffle_vector(f, m, vconst(I32, list(range(2 * self.n_sub))))

    def sub_weights(self, tb: ir.Value, s: int) -> tuple[list[ir.Value], ir.Value, ir.Value | None]:
        """Sub-block s of the unpacked super-block at tb: its sub / 4 weight
        vectors <4W x i8>, d sc_s and (layouts with minimums) -dmin m_s, W lanes each."""
        kb, W, per = self.kb, self.W, self.sub
        ws = [kb.vload(tb, 4 * W * (per // 4 * s + i), 4 * W) for i in range(per // 4)]
        return ws, *self.unpacked_factors(tb, s)

    def unpacked_factors(self, tb: ir.Value, s: int) -> tuple[ir.Value, ir.Value | None]:
        """d sc_s and (layouts with minimums) -dmin m_s of the unpacked super-block at tb."""
        W = self.W
        scv = self.vec(tb, 256 * W + 4 * W * s)
        mv = self.vec(tb, 256 * W + 4 * W * (self.n_sub + s)) if self.minimums else None
        return scv, mv

    def _cors(self, slots: list[ir.Value], j: ir.Value) -> list[ir.Value]:
        """Each slot's 16 corrections of super-block j."""
        kb, b = self.kb, self.b
        return [kb.gep(sp, b.add(i64(self.k), b.mul(j, i64(64)))) for sp in slots]

    def _sub_scaled(self, a: ir.Value, cor: ir.Value, s: int, scv: ir.Value, mv: ir.Value | None,
                    f: ir.Value) -> ir.Value:
        """f + sub-block s's int32 sums ``a`` (seeded) times d sc_s (with
        minimums: plus -dmin m_s bsum_s)."""
        kb, b = self.kb, self.b
        f = kb.fma(b.sitofp(a, self.vf), scv, f)
        if mv is not None:
            f = kb.fma(mv, self.bcast(kb.gep(cor, 4 * s), F32), f)
        return f

    def _finish(self, j: ir.Value, slots: list[ir.Value], fsb: list[ir.Value], accs: list[ir.Value]) -> list[ir.Value]:
        """Each token's accumulator + its super-block sum f times d_x."""
        kb, b = self.kb, self.b
        out = []
        for sp, f, acc in zip(slots, fsb, accs):
            dx = self.bcast(kb.gep(sp, b.add(i64(self.k + 64 * self.nb), b.mul(j, i64(4)))), F32)
            out.append(kb.fma(f, dx, acc))
        return out

    def block(self, j: ir.Value, tb: ir.Value, slots: list[ir.Value], accs: list[ir.Value]) -> list[ir.Value]:
        kb, b, W = self.kb, self.b, self.W
        zero_f = ir.Constant(self.vf, [0.0] * W)
        zero_i = ir.Constant(self.vi, [0] * W)
        fsb = [zero_f] * len(slots)
        qs = [kb.gep(sp, b.mul(j, i64(QK_K))) for sp in slots]
        cors = self._cors(slots, j)
        n_sub, per = self.n_sub, self.sub
        for s in range(n_sub):
            ws, scv, mv = self.sub_weights(tb, s)
            for p in range(len(slots)):
                seed = self.bcast(kb.gep(cors[p], 4 * s), I32) if self.offset else zero_i
                a = self.dots(seed, ws, kb.gep(qs[p], per * s))
                fsb[p] = self._sub_scaled(a, cors[p], s, scv, mv, fsb[p])
        return self._finish(j, slots, fsb, accs)

    # --- AMX tiles (``matmul/amx_tiles``) --------------------------------------------------
    amx_step = 1
    amx_ahead = 1   # besides, a super-block's products all go before its epilogues

    @property
    def amx_sums_bytes(self) -> int:
        """A super-block's int32 sums: 16 x 16 per sub-block."""
        return self.n_sub * amx.ROWS * amx.ROW_BYTES

    @property
    def amx_panel_bytes(self) -> int:
        return amx_panel_bytes(self.kern.layout)

    def amx_fill_panel(self, slots: list[ir.Value], panel: ir.Value) -> None:
        kb, b = self.kb, self.b
        with kb.loop(0, self.nb, name="apanel") as j:
            pj = kb.gep(panel, b.mul(j, i64(self.amx_panel_bytes)))
            cors = self._cors(slots, j)
            for p, sp in enumerate(slots):
                dx = kb.gep(sp, b.add(i64(self.k + 64 * self.nb), b.mul(j, i64(4))))
                srcs = [(dx, 4 * p)] + [(kb.gep(cors[p], 4 * s), 4 * amx.ROWS * (1 + s) + 4 * p)
                                        for s in range(self.n_sub)]
                for src, at in srcs:
                    v = b.load(b.bitcast(src, ir.PointerType(I32)), align=4)
                    b.store(v, b.bitcast(kb.gep(pj, at), ir.PointerType(I32)), align=4)

    def amx_products(self, j: ir.Value, tb: ir.Value, a0: ir.Value, sums: ir.Value) -> list[amx.Product]:
        """Super-block j: per sub-block one ``tdpbsud`` (the ternary types'
        256 values: four, summed in the tile) of 16 token slots' quants by the
        sub-block's weight vectors as they lie at tb, its sums stored at
        ``sums`` + 1 KB per sub-block."""
        kb, b, W = self.kb, self.b, self.W
        a_blk = kb.gep(a0, b.mul(j, i64(QK_K)))
        per = self.sub
        k = min(per, amx.ROW_BYTES)
        return [amx.Product(amx.ROWS, k, kb.gep(a_blk, per * s), self.slot_bytes, kb.gep(tb, 4 * W * (per // 4) * s),
                            kb.gep(sums, amx.ROWS * amx.ROW_BYTES * s), per // k) for s in range(self.n_sub)]

    def amx_epilogue(self, tb: ir.Value, pj: ir.Value, accs: list[ir.Value], sums: ir.Value) -> list[ir.Value]:
        """Per token, its chain over the sub-blocks as ``block`` makes it (token
        by token here: one sum f live at a time besides the accumulators)."""
        kb, b, W = self.kb, self.b, self.W
        new = []
        for p, acc in enumerate(accs):
            f = ir.Constant(self.vf, [0.0] * W)
            for s in range(self.n_sub):
                scv, mv = self.unpacked_factors(tb, s)
                a = amx_row(kb, kb.gep(sums, amx.ROWS * amx.ROW_BYTES * s), p)
                cor = kb.gep(pj, 4 * amx.ROWS * (1 + s) + 4 * p)
                if self.offset:
                    a = b.add(self.bcast(cor, I32), a)
                f = kb.fma(b.sitofp(a, self.vf), scv, f)
                if mv is not None:
                    f = kb.fma(mv, self.bcast(cor, F32), f)
            new.append(kb.fma(f, self.bcast(kb.gep(pj, 4 * p), F32), acc))
        return new
