"""The integer path of ``qmatmul`` (``act="q8"``) on 32-value block weights
(GGUF Q8_0, Q4_0, Q5_0, Q4_1, Q5_1), as llama.cpp's ``ggml_vec_dot_q*_0_q8_0``
and ``ggml_vec_dot_q*_1_q8_1``.

The numbers are ``ir.ops.qmatmul_ref`` with ``act="q8"``: x is quantized per
block of 32 (d_x = float16(max|x| / 127), q_x = rint(x * 127 / max|x|)) and
out[r] = sum over blocks of d_w * d_x * (integer sum of q_w * q_x), plus, for
the offset layouts Q4_1 / Q5_1 (value = d_w q_w + m_w, q_w unsigned),
m_w * d_x * (integer sum of q_x).

Per call (one thread)
---------------------
1. Quantize x into this thread's scratch, one slot per token row, each laid
   out for the dot loop (bytes, nb = K / 32 blocks):

       [0, K)          q_x, 32 int8 per block
       [K, K + 32 nb)  per block 8 int32: the bias correction c_b in lane 0, zeros
                       (offset layouts: 8 float32, d_x * sum(q_x) in lane 0, zeros)
       [.., + 32 nb)   per block 8 float32: d_x repeated

   Every thread quantizes the whole row itself: no barrier, and it is a few
   hundred nanoseconds against the rows' weight traffic. Rows x [T, K] of
   a batch of decode rows (the ``decode_rows`` attribute, set by
   ``passes/int_dot``) are quantized ``decode_rows`` at a time, each into
   its own slot; then each weight tile is read once, each block unpacked
   once, and multiplied with up to ``slots`` quantized rows (each with its
   own accumulators), instead of streaming and unpacking the weights again
   for every row. Every row does the one-row code's operations in its
   order, so each gets the decode step's numbers, bit for bit. Prompt
   chunks (``gemm``) run as a GEMM (``matmul/gemm``) where the host
   and shape allow, else this way, ``_GEMM_FALLBACK_ROWS`` at a time;
   [T, K] with neither attribute run one row at a time.
2. Its share of the rows, ``_ROWS`` at a time (the kernel attribute ``rows``
   overrides it, and ``unroll`` the ``_UNROLL`` block groups per loop
   iteration), over the blocks ``G`` at a time (G = 2 at vector width 16: one
   512-bit register holds two blocks; otherwise 1). Weight quants are made
   unsigned so that one ``vpdpbusd`` (unsigned x signed bytes, four products
   summed into each int32 lane) does a block: Q8_0 as q + 128 (xor 0x80),
   Q4_0 as the raw nibble (q + 8), Q5_0 as nibble | high bit << 4 (q + 16);
   Q4_1 and Q5_1 quants are unsigned already (bias 0).
   The bias comes back as c_b = -bias * sum(q_x of block b), which seeds the
   int32 accumulator (lane 0 of the block's 8 lanes), so the 8 lanes of a
   block sum to the exact integer dot product. Unlike llama.cpp's sign trick
   (|x| unsigned, x's sign moved onto w) this is exact for every weight byte,
   -128 included.
   The int32 lanes are converted to float and multiplied into float
   accumulators with d_w * d_x (one FMA per block group); the offset
   layouts add a second FMA, m_w (8 lanes per block, as d_w) times the
   slot's d_x * sum(q_x) lanes (exact in float32: a float16 times an integer
   below 2^12); one horizontal sum per row at the end. The symmetric
   layouts' code has no trace of the offset term.

Without VNNI the same int32 lanes come from a portable widening multiply
(zext/sext to i16, products of even and odd lanes added in i32, which LLVM
turns into ``vpmaddwd`` on x86). It is correct but slower than the float
kernels (about half their speed on znver4 forced to it), so the pass should
only run where ``Target.int_dot``.

The K-quants' integer path (``act="q8k"``: 256-value activation blocks,
sub-block scales) is ``matmul.int_kquants.KQuantIntKernel``: its own
quantization, slots and tiles, driven by the same ``emit_int_matvec``
(threads' row shares, groups of ``decode_rows`` rows, slots sharing each
unpacked weight block).

QSF's 64-value blocks (``act="q8"`` too: each is two 32-value blocks
sharing d and the offset, ``ir.int_dot``) are ``matmul.int_qsf.QSFIntKernel``,
a subclass of this module's kernel that says where a 32-value half lives
and how it becomes unsigned quants; the ternary type's dot product has no
multiply (masked byte sums).

Float accumulation is float32 in a different order than the reference's
float64: results agree to ~1e-6 relative of the size of the terms,
sum |d_w d_x q_w q_x| (+ |m_w d_x sum q_x|).
"""
from __future__ import annotations

from typing import NamedTuple

import llvmlite.ir as ir

from ir.quant import ACT_BLOCK

from ..act_quant import quantize_q8_block
from ..emit import F32, I32, KernelBuilder, i64
from ..kernels import KernelSig
from ..simd import I1, I8, I16, call, dpbusd, gather_f16, shuffle, vconst
from .common import PREFETCH_BYTES, out_rows, tuned

QK = ACT_BLOCK["q8"]
#: weight rows per tile (rows of at least _LONG_ROW columns; shorter rows
#: go one at a time: one sequential stream, which the prefetcher follows best
#: -- on znver4 4-row tiles of 640-column Q8_0 rows ran at 8 GB/s, single
#: rows at 33) and block groups per loop iteration
_ROWS = 4
_LONG_ROW = 8192
_UNROLL = 2
#: accumulators (rows x unroll x slots) a multi-row tile may keep: with the
#: unpacked weights, each slot's quants and temporaries, 16 fit the 32
#: vector registers of AVX-512 (the kernel attribute ``slots`` overrides)
_SLOT_ACCS = 16


class _Slot(NamedTuple):
    """Scratch of one quantized activation row: quants, d_x, and the same
    per-block lanes seen as ``init`` (int32 bias seeds; symmetric layouts)
    or as ``sxd`` (float32 d_x * sum(q_x); offset layouts), None for the other."""

    q: ir.Value
    dx: ir.Value
    init: ir.Value | None
    sxd: ir.Value | None


def slot_bytes(k: int) -> int:
    """Scratch bytes of one quantized row of K columns, whatever the layout:
    96 per block of 32 (quants; bias seeds or d_x * sum(q_x); d_x), rounded
    up to a cache line."""
    return ((k // QK) * 96 + 63) // 64 * 64


#: rows quantized at once for a prompt chunk (``gemm``) that the GEMM does
#: not take (rows not a multiple of its tile, no VNNI): decode's arithmetic
#: ``PROMPT_ROWS`` at a time, as before the GEMM
_GEMM_FALLBACK_ROWS = 8


def slot_count(sig: KernelSig) -> int:
    """Rows quantized at once: ``decode_rows`` for a batch of decode rows,
    ``_GEMM_FALLBACK_ROWS`` for a prompt chunk, else 1."""
    if len(sig.in_types[0].shape) < 2:
        return 1
    return int(sig.attr.get("decode_rows", _GEMM_FALLBACK_ROWS if sig.attr.get("gemm") else 1))


def fold_pairs(kb: KernelBuilder, p: ir.Value) -> ir.Value:
    """<16g x i32> pair sums of g blocks (16 lanes each) -> <8g x i32>, each
    block's 8 lanes summing to its 16: the portable dot's last step."""
    g = p.type.count // 16
    lo = [blk * 16 + i for blk in range(g) for i in range(8)]
    return kb.b.add(shuffle(kb.b, p, p, lo), shuffle(kb.b, p, p, [i + 8 for i in lo]))


class IntKernel:
    """The decode kernel of the 32-value block layouts (the type's row
    ``qt`` says its bytes per block, the bias that makes its quants
    unsigned, whether a block has an offset m: value = d q + m, and where
    each field sits). Hooks a sibling layout family overrides
    (``int_qsf``): ``block_ptr``, ``unsigned_block`` (also the GEMM's
    unpacking), ``group_quants``, ``block_scales`` and ``dot``;
    ``bytes_per_block`` is the weight bytes per 32 values (the prefetch span)."""

    #: the GEMM builds its tiles from the stored nibble bytes (``NibbleIntKernel``)
    #: rather than transposing ``unsigned_block``
    nibble_tiles = False

    def __init__(self, kb: KernelBuilder, sig: KernelSig, qt) -> None:
        xt, wt = sig.in_types[:2]
        self.qt = qt
        self.kb, self.b = kb, kb.b
        self.layout = wt.layout
        self.bb, self.bias, self.offset = qt.block_bytes, qt.zero, qt.offset
        self.bytes_per_block = self.bb
        self.n, self.k = int(wt.shape[0]), int(wt.shape[1])
        if self.k % QK:
            raise NotImplementedError(f"row length {self.k} is not a multiple of {QK}")
        self.nb = self.k // QK
        self.out, self.n_out = out_rows(kb, sig)
        self.G = 2 if kb.vw >= 16 else 1
        self.U = tuned(kb, sig.attr, "unroll", _UNROLL)
        self.ahead = int(sig.attr.get("prefetch", PREFETCH_BYTES))
        self.xt = xt
        self.w = kb.in_raw[1]

    def slot(self, i: ir.Value) -> _Slot:
        """The scratch pointers of slot ``i`` (see ``_Slot``)."""
        kb, b = self.kb, self.b
        s = kb.gep(kb.scratch, b.mul(i, i64(slot_bytes(self.k))))
        lanes = kb.gep(s, self.k)
        init = None if self.offset else b.bitcast(lanes, ir.PointerType(I32))
        sxd = b.bitcast(lanes, ir.PointerType(F32)) if self.offset else None
        return _Slot(s, b.bitcast(kb.gep(s, self.k + 32 * self.nb), ir.PointerType(F32)), init, sxd)

    # --- step 1: x -> q8 blocks in scratch --------------------------------------------
    def quantize(self, xrow: ir.Value, sl: _Slot) -> None:
        """Row x[xrow / K] into slot ``sl``."""
        kb, b = self.kb, self.b
        with kb.loop(0, self.nb, name="qblk") as j:
            q, d, sx = quantize_q8_block(kb, b.add(xrow, b.mul(j, i64(QK))))
            kb.vstore(q, sl.q, b.mul(j, i64(QK)))
            if self.offset:  # d_x (a float16) times |sx| <= 32 * 127 < 2^12: exact in float32
                sxd = b.fmul(d, b.sitofp(sx, F32))
                kb.vstore(b.insert_element(kb.vzero(8), sxd, i64(0)), sl.sxd, b.mul(j, i64(8)))
            else:
                c = b.mul(sx, ir.Constant(I32, -self.bias))
                init = b.insert_element(vconst(I32, [0] * 8), c, i64(0))
                kb.vstore(init, sl.init, b.mul(j, i64(8)))
            kb.vstore(kb.splat(d, 8), sl.dx, b.mul(j, i64(8)))

    # --- step 2: weights ------------------------------------------------------------------
    def block_ptr(self, row: ir.Value, j: ir.Value) -> ir.Value:
        b = self.b
        return self.kb.gep(self.w, b.mul(b.add(b.mul(row, i64(self.nb)), j), i64(self.bb)))

    def unsigned_block(self, bp: ir.Value, j: ir.Value) -> ir.Value:
        """<32 x i8>: the quants of block j (stored at bp) plus the bias (0..255 as unsigned)."""
        return self.b.xor(self.kb.vload(bp, self.qt.at("qs"), QK), vconst(I8, [0x80] * QK))

    def dot(self, u: ir.Value, xq: ir.Value, init: ir.Value, g: int) -> ir.Value:
        """<8g x i32>: per block, 8 lanes summing to init + sum(u * xq)."""
        kb, b = self.kb, self.b
        name = dpbusd(kb.target, g)
        if name:
            return call(kb, name, init.type, [init, u, xq])
        n = QK * g
        u16 = b.zext(u, ir.VectorType(I16, n))
        x16 = b.sext(xq, ir.VectorType(I16, n))
        v32 = ir.VectorType(I32, n // 2)
        ev, od = list(range(0, n, 2)), list(range(1, n, 2))
        p = b.add(b.mul(b.sext(shuffle(kb.b, u16, u16, ev), v32), b.sext(shuffle(kb.b, x16, x16, ev), v32)),
                  b.mul(b.sext(shuffle(kb.b, u16, u16, od), v32), b.sext(shuffle(kb.b, x16, x16, od), v32)))
        return b.add(fold_pairs(kb, p), init)

    def group(self, row: ir.Value, j: ir.Value, g: int, accs: list[ir.Value],
               slots: list[_Slot]) -> list[ir.Value]:
        """accs[s] + (int32 lanes of blocks j..j+g-1 of row, times slot s's
        quants) * d_w * d_x[s] (+ m_w * d_x[s] * sum(q_x[s]) for the offset
        layouts), for every slot: the weight blocks are loaded and made
        unsigned once, then each slot does exactly the one-row code's
        operations on its own accumulator."""
        kb, b = self.kb, self.b
        u, bps = self.group_quants(row, j, g)
        js = [b.add(j, i64(i)) for i in range(g)]
        dw, mw = (None if v is None else self.spread(v) for v in self.block_scales(bps, js))
        zero = vconst(I32, [0] * (8 * g))
        out = []
        for sl, acc in zip(slots, accs):
            xq = kb.vload(sl.q, b.mul(j, i64(QK)), QK * g)
            init = zero if self.offset else kb.vload(sl.init, b.mul(j, i64(8)), 8 * g)
            dots = b.sitofp(self.dot(u, xq, init, g), ir.VectorType(F32, 8 * g))
            scale = b.fmul(dw, kb.vload(sl.dx, b.mul(j, i64(8)), 8 * g))
            acc = kb.fma(dots, scale, acc)
            if mw is not None:  # lane 0 of each block: m_w * d_x sum(q_x); the other lanes add m_w * 0
                acc = kb.fma(mw, kb.vload(sl.sxd, b.mul(j, i64(8)), 8 * g), acc)
            out.append(acc)
        return out

    def group_quants(self, row: ir.Value, j: ir.Value, g: int) -> tuple[ir.Value, list[ir.Value]]:
        """The unsigned quants of blocks j .. j+g-1 of a row (<32g x i8>, what
        ``_dot`` takes) and the g blocks' addresses (for ``block_scales``)."""
        b = self.b
        bps = [self.block_ptr(row, b.add(j, i64(i))) for i in range(g)]
        us = [self.unsigned_block(bp, b.add(j, i64(i))) for i, bp in enumerate(bps)]
        return (us[0] if g == 1 else shuffle(self.kb.b, us[0], us[1], list(range(64)))), bps

    def block_scales(self, bps: list[ir.Value], js: list[ir.Value]) -> tuple[ir.Value, ir.Value | None]:
        """<n x float> d_w of the n blocks at bps (32-value blocks js of
        their rows: a stored block may hold several, with scales of their
        own), and their m_w (offset layouts; else None): here the float16
        fields d and m."""
        return (gather_f16(self.kb, bps, self.qt.at("d")),
                gather_f16(self.kb, bps, self.qt.at("m")) if self.offset else None)

    def spread(self, v: ir.Value) -> ir.Value:
        """<g x float> -> <8g x float>: each block's value in its 8 lanes."""
        return shuffle(self.kb.b, v, v, [i // 8 for i in range(8 * v.type.count)])

    def tile(self, r0: ir.Value, R: int, slots: list[_Slot], ts: list[ir.Value]) -> None:
        """out[ts[s], r0 .. r0+R-1] for the quantized rows in ``slots``
        (token row ``ts[s]``). Each slot's sums are the one-row code's, in
        its order, whatever the number of slots beside it."""
        kb, b, G, U = self.kb, self.b, self.G, self.U
        P = len(slots)
        step = G * U
        nmain = self.nb - self.nb % step
        rows = [b.add(r0, i64(i)) for i in range(R)]
        vz = ir.Constant(ir.VectorType(F32, 8 * G), [0.0] * (8 * G))

        def at(i: int, u: int, p: int) -> int:
            return (i * U + u) * P + p

        accs = [vz] * (R * U * P)
        if nmain:
            with kb.loop_carry(0, nmain, accs, step=step, name="blk") as (j, cur, setv):
                cur = list(cur)
                if self.ahead:
                    for i in range(R):
                        kb.prefetch(kb.gep(self.block_ptr(rows[i], j), self.ahead), self.bytes_per_block * step)
                for i in range(R):
                    for u in range(U):
                        new = self.group(rows[i], b.add(j, i64(u * G)), G,
                                          [cur[at(i, u, p)] for p in range(P)], slots)
                        for p in range(P):
                            cur[at(i, u, p)] = new[p]
                setv(cur)
            accs = list(kb.last_carry)
        tails: list[list[ir.Value] | None] = [None] * R
        for jt in range(nmain, self.nb, G):
            g = min(G, self.nb - jt)
            for i in range(R):
                if g == G:
                    new = self.group(rows[i], i64(jt), g, [accs[at(i, 0, p)] for p in range(P)], slots)
                    for p in range(P):
                        accs[at(i, 0, p)] = new[p]
                else:
                    z = ir.Constant(ir.VectorType(F32, 8 * g), [0.0] * (8 * g))
                    tails[i] = self.group(rows[i], i64(jt), g, tails[i] if tails[i] is not None else [z] * P,
                                           slots)
        out, n_out = self.out, self.n_out
        for i in range(R):
            for p in range(P):
                # strict (no reassociation): every slot sums in the one-row code's order
                v = accs[at(i, 0, p)]
                for u in range(1, U):
                    v = b.fadd(v, accs[at(i, u, p)])
                s = kb.hsum(v)
                if tails[i] is not None:
                    s = b.fadd(s, kb.hsum(tails[i][p]))
                kb.store(s, out, b.add(b.mul(ts[p], i64(n_out)), rows[i]))


class NibbleIntKernel(IntKernel):
    """Q4_0, Q4_1, Q5_0, Q5_1: 32 nibbles in 16 bytes (low halves first),
    Q5's fifth bits in a 32-bit ``qh``."""

    nibble_tiles = True

    def unsigned_block(self, bp: ir.Value, j: ir.Value) -> ir.Value:
        kb, b = self.kb, self.b
        qs = kb.vload(bp, self.qt.at("qs"), 16)
        nib = shuffle(kb.b, b.and_(qs, vconst(I8, [0x0F] * 16)), b.lshr(qs, vconst(I8, [4] * 16)), list(range(32)))
        if not self.qt.has("qh"):
            return nib
        qh = b.load(b.bitcast(kb.gep(bp, self.qt.at("qh")), ir.PointerType(I32)), align=1)
        hb = b.bitcast(qh, ir.VectorType(I1, QK))
        return b.or_(nib, b.select(hb, vconst(I8, [16] * QK), vconst(I8, [0] * QK)))


def emit_int_matvec(kb: KernelBuilder, sig: KernelSig, kern) -> None:
    """qmatmul on the integer path with the decode kernel ``kern`` (a
    ``IntKernel``, or a sibling family's): x [K] (decode), or [T, K] in
    groups of ``slot_count`` rows: quantize the group, then per weight tile
    every row, ``slots`` rows at a time sharing the unpacked weight blocks."""
    b = kb.b
    lo, hi = kb.thread_share(kern.n)
    R = tuned(kb, sig.attr, "rows", _ROWS if kern.k >= _LONG_ROW else 1)
    rows_main = b.sub(hi, b.srem(b.sub(hi, lo), i64(R)))
    m = kb.rows_of(kern.xt.shape)
    S = slot_count(sig)
    P = min(S, tuned(kb, sig.attr, "slots", max(1, _SLOT_ACCS // (R * kern.U)))) if S > 1 else 1

    def tiles(t0: ir.Value, n: ir.Value | None) -> None:
        """Every weight tile of this thread against rows t0 .. t0+n-1 (in
        slots 0 .. n-1), P slots at a time, then the rest r < P in tiles of
        the powers of two in r (5 rows: 4 + 1), so that a step of a few
        sequences shares the unpacked blocks too (n None: the one row t0 in
        slot 0, the decode step's code)."""
        def tile_at(r0: ir.Value, R_: int, s0: ir.Value, q: int) -> None:
            ss = [b.add(s0, i64(p)) for p in range(q)]
            kern.tile(r0, R_, [kern.slot(s) for s in ss], [b.add(t0, s) for s in ss])

        def over_slots(r0: ir.Value, R_: int) -> None:
            if n is None:
                kern.tile(r0, R_, [kern.slot(i64(0))], [t0])
                return
            rest = b.srem(n, i64(P))
            n_main = b.sub(n, rest)
            with kb.loop(0, n_main, step=P, name="slots") as s0:
                tile_at(r0, R_, s0, P)
            q = 1 << max(0, (P - 1).bit_length() - 1)     # the largest power of two below P
            while q >= 1 and P > 1:
                with kb.if_then(b.icmp_signed("!=", b.and_(rest, i64(q)), i64(0))):
                    # bits of rest above q went to the tiles before this one
                    tile_at(r0, R_, b.add(n_main, b.and_(rest, i64(-2 * q))), q)
                q //= 2

        with kb.loop(lo, rows_main, step=R, name="rt") as r0:
            over_slots(r0, R)
        with kb.loop(rows_main, hi, name="r1") as r:
            over_slots(r, 1)

    def group(t0: ir.Value, n: ir.Value | None) -> None:
        """Quantize rows t0 .. t0+n-1 of x (n <= S), then each weight tile against all of them."""
        if n is None:
            kern.quantize(b.mul(t0, i64(kern.k)), kern.slot(i64(0)))
        else:
            with kb.loop(0, n, name="quant") as i:
                kern.quantize(b.mul(b.add(t0, i), i64(kern.k)), kern.slot(i))
        tiles(t0, n)

    if isinstance(m, ir.Constant) and m.constant == 1:
        group(i64(0), None)
    elif S == 1:
        with kb.loop(0, m, name="tok") as t:
            group(t, None)
    else:
        with kb.loop(0, m, step=S, name="tok") as t0:
            left = b.sub(m, t0)
            group(t0, b.select(b.icmp_signed("<", left, i64(S)), left, i64(S)))
