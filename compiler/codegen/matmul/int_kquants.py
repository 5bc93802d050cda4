"""The integer path of ``qmatmul`` on K-quant weights (``act="q8k"``: GGUF
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), as llama.cpp's ``ggml_vec_dot_q*_K_q8_K``.

The numbers are ``ir.int_dot.qmatmul_q8k_ref``: x is quantized per
256 values (Q8_K: float32 d_x, int8 q_x, per-16 sums of q_x) and each
super-block adds d_w d_x * (integer sum over sub-blocks of sc * q_w . q_x)
- dmin_w d_x * (integer sum of m * bsum). The integer parts are exact, so
the kernel differs from the reference only in float32 rounding.

Scheduling is ``matmul/int_q8``'s (``emit_int_matvec`` drives this class
through ``slot`` / ``quantize`` / ``tile``): each thread quantizes the
rows it needs into its scratch, ``decode_rows`` rows at a time, then reads
each weight super-block once, unpacks it once, and multiplies it with every
quantized row of the group, each row with the one-row code's operations in
its order (bit for bit the decode step's result).

A layout is a subclass (the traits table's ``int_kernel``) that says how its bytes become
unsigned quants (``run``: 32 values) and integer sub-block scales and
minimums (``scales``), its sub-block size, and whether its values carry a
minimum (Q2_K, Q4_K, Q5_K: d sc q - dmin m) or an offset (Q3_K, Q6_K:
signed quants stored or made unsigned as q + 4, q + 32). Per super-block
and weight row (shared by the rows of a group):

* quants made unsigned bytes (Q2_K 0..3, Q3_K 0..7, Q4_K 0..15, Q5_K
  0..31, Q6_K 0..63), in chunks of CH = 64 values at vector width 16 (one
  512-bit register), else 32. A chunk is a few runs of 32 values that the
  same byte operations produce (Q4_K: the low nibbles of 64 stored bytes
  are runs 0 and 2; Q2_K: one shift of its 64 bytes of 2-bit fields gives
  runs i and 4 + i); the activation slot stores x's runs in that order, so
  the quants need no shuffle (high bits, as Q3_K's, Q5_K's and Q6_K's,
  are two 32-byte pieces, shifted apart, then joined);
* the sub-block scales as 16-bit lanes, one per pair of values of the chunk.

Per row of the group: ``vpmaddubsw`` (unsigned weight bytes times signed
activation bytes, adjacent pairs summed to int16: at most 2 * 63 * 127,
never saturating) then ``vpmaddwd`` by the scale lanes, added to an int32
accumulator (``vpdpwssd`` on VNNI hosts): two or three instructions per 64
values. The sub-block minimums are one ``vpmaddwd`` of the 16 activation
partial sums by the minimum of each sum's sub-block; an offset is one
``vpdpwssd`` of the same sums by -offset sc into the integer sum. Then the
int32 lanes are converted once per super-block and multiplied into float
accumulators with d_w d_x (with minimums: the sum's lanes folded to 8,
beside the 8 lanes of the minimums' sum, so that one convert and one FMA
with d_w d_x x8, -dmin_w d_x x8 do both); one horizontal sum per row at
the end.

Without the x86 instructions (other targets; tests force it) the same
int16 and int32 lanes come from portable widening multiplies: exact, the
same integers, slower.
"""
from __future__ import annotations

from typing import NamedTuple

import llvmlite.ir as ir

from ir.int_dot import BSUM

from ..act_quant import QK_K, quantize_q8k_block
from ..emit import F32, I32, KernelBuilder, i64
from ..kernels import KernelSig
from ..simd import HALF, I8, I16, call, concat, madd, pair_sums, shuffle, vconst
from .common import PREFETCH_BYTES, out_rows, tuned
from .decode_kquants import q3k_scales, q3k_scales_at

RUN = 32
_UNROLL = 1


class KSlot(NamedTuple):
    """Scratch of one quantized activation row: quants (in chunk order),
    per-16 sums (int16), d_x (float32) per super-block."""

    q: ir.Value
    bs: ir.Value
    dx: ir.Value


def slot_bytes(k: int) -> int:
    """Scratch bytes of one quantized row: per super-block 256 quants, 16
    int16 sums and a float32 d_x, rounded up to a cache line."""
    nb = k // QK_K
    return (k + 36 * nb + 63) // 64 * 64


def chunk_runs(runs_64: list[tuple[int, int]], vw: int) -> list[tuple[int, ...]]:
    """The runs of 32 values of each chunk, in the order the slot stores them."""
    return runs_64 if vw >= 16 else [(r,) for r in range(QK_K // RUN)]


def maddubs(kb: KernelBuilder, u: ir.Value, x: ir.Value) -> ir.Value:
    """<n x i8> unsigned u, signed x -> <n/2 x i16>: u[2i] x[2i] + u[2i+1] x[2i+1]
    (exact for the K-quants' ranges: never saturates)."""
    b, n = kb.b, u.type.count
    names = madd(kb.target, n)
    if names:
        return call(kb, names[0], ir.VectorType(I16, n // 2), [u, x])
    v16 = ir.VectorType(I16, n)
    return pair_sums(b, b.mul(b.zext(u, v16), b.sext(x, v16)))


def maddwd(kb: KernelBuilder, a: ir.Value, s: ir.Value) -> ir.Value:
    """<2n x i16> a, s -> <n x i32>: a[2i] s[2i] + a[2i+1] s[2i+1]."""
    b, n = kb.b, a.type.count
    names = madd(kb.target, 2 * n)
    if names:
        return call(kb, names[1], ir.VectorType(I32, n // 2), [a, s])
    v32 = ir.VectorType(I32, n)
    return pair_sums(b, b.mul(b.sext(a, v32), b.sext(s, v32)))


def dpwssd(kb: KernelBuilder, acc: ir.Value, a: ir.Value, s: ir.Value) -> ir.Value:
    """acc + maddwd(a, s): ``vpdpwssd`` on VNNI hosts (LLVM may still split
    one into ``vpmaddwd`` + ``vpaddd`` where that shortens a dependency chain)."""
    names = madd(kb.target, 2 * a.type.count)
    if names and names[2]:
        return call(kb, names[2], acc.type, [acc, a, s])
    return kb.b.add(acc, maddwd(kb, a, s))


class KScales(NamedTuple):
    """A super-block's integer sub-block factors and its float ones."""

    sc: ir.Value            # <S x i16>: the scales of its S = 256 / sub sub-blocks
    m: ir.Value | None      # <S x i16>: their minimums (layouts with minimums)
    f2: ir.Value            # <2 x float>: d_w, and -dmin_w (0 without minimums)


class _Weights(NamedTuple):
    """One super-block of one weight row, unpacked for every row of a group."""

    u: list[ir.Value]          # per chunk <CH x i8>: unsigned quants
    sc: list[ir.Value]         # per chunk <CH/2 x i16>: the sub-block scale of each pair
    off: ir.Value | None       # <2L x i16>: -offset sc of each 16-value partial sum (Q3_K, Q6_K)
    mins: ir.Value | None      # <16 x i16>: the minimum of each 16-value partial sum (Q2_K, Q4_K, Q5_K)
    f: ir.Value                # float factors: <16 x float> d_w x8, -dmin_w x8 (minimums); <L x float> d_w


class KQuantIntKernel:
    """``slot`` / ``quantize`` / ``tile`` for ``int_q8.emit_int_matvec``;
    a layout's subclass says how its bytes become unsigned quants (``run``)
    and sub-block factors (``scales``). The type's row (``qt``) gives the
    bytes per super-block, the values per sub-block (one scale, one
    minimum: ``sub``), the zero point added to the signed quants to make
    them unsigned bytes (Q3_K 4, Q6_K 32: ``offset``), whether value =
    d sc q - dmin m (``minimums``: Q2_K, Q4_K, Q5_K) and the fields' offsets."""

    #: the runs of 32 values in each 64-value chunk (vector width 16):
    #: runs that one byte operation on 64 consecutive stored bytes produces
    runs_64: list[tuple[int, int]] = []

    def __init__(self, kb: KernelBuilder, sig: KernelSig, qt) -> None:
        xt, wt = sig.in_types[:2]
        self.qt, self.at = qt, qt.at
        self.sub, self.offset, self.minimums = qt.sub_block, qt.zero, qt.has("dmin")
        self.layout = wt.layout
        self.kb, self.b = kb, kb.b
        self.n, self.k = int(wt.shape[0]), int(wt.shape[1])
        if self.k % QK_K:
            raise NotImplementedError(f"row length {self.k} is not a multiple of {QK_K}")
        self.nb = self.k // QK_K
        self.bb = qt.block_bytes
        self.runs = chunk_runs(self.runs_64, kb.vw)
        self.CH = RUN * len(self.runs[0])
        self.L = self.CH // 4                  # int32 lanes of a chunk's sums
        self.A = 16 if self.minimums else self.L   # float accumulator lanes
        self.out, self.n_out = out_rows(kb, sig)
        self.U = tuned(kb, sig.attr, "unroll", _UNROLL)
        self.ahead = int(sig.attr.get("prefetch", PREFETCH_BYTES))
        self.xt = xt
        self.w = kb.in_raw[1]
        #: natural run r -> its position in the slot's chunk order
        self.pos = {r: i for i, r in enumerate(r for c in self.runs for r in c)}

    def slot(self, i: ir.Value) -> KSlot:
        kb, b = self.kb, self.b
        s = kb.gep(kb.scratch, b.mul(i, i64(slot_bytes(self.k))))
        bs = b.bitcast(kb.gep(s, self.k), ir.PointerType(I16))
        dx = b.bitcast(kb.gep(s, self.k + 32 * self.nb), ir.PointerType(F32))
        return KSlot(s, bs, dx)

    # --- step 1: x -> Q8_K blocks in scratch ------------------------------------------
    def quantize(self, xrow: ir.Value, sl: KSlot) -> None:
        """Row x[xrow / K] into slot ``sl`` (``ir.int_dot.quantize_q8k_rows``)."""
        kb, b = self.kb, self.b
        with kb.loop(0, self.nb, name="qblk") as j:
            q, d, v = quantize_q8k_block(kb, b.add(xrow, b.mul(j, i64(QK_K))))
            base = b.mul(j, i64(QK_K))
            for run in range(QK_K // RUN):
                piece = shuffle(b, q, None, list(range(RUN * run, RUN * run + RUN)))
                kb.vstore(piece, sl.q, b.add(base, i64(RUN * self.pos[run])))
            kb.vstore(v, sl.bs, b.mul(j, i64(16)))
            kb.store(d, sl.dx, j)

    # --- step 2: weights (a layout's ``run`` and ``scales``) -------------------------------
    def block_ptr(self, row: ir.Value, j: ir.Value) -> ir.Value:
        b = self.b
        return self.kb.gep(self.w, b.mul(b.add(b.mul(row, i64(self.nb)), j), i64(self.bb)))

    def _bytes(self, bp: ir.Value, at: int, n: int = RUN) -> ir.Value:
        return self.kb.vload(bp, at, n)

    def _shift_to(self, v: ir.Value, sh: int) -> ir.Value:
        """Bytes of v shifted left by sh (right by -sh)."""
        b = self.b
        if sh > 0:
            return b.shl(v, vconst(I8, [sh] * v.type.count))
        if sh < 0:
            return b.lshr(v, vconst(I8, [-sh] * v.type.count))
        return v

    def _bits(self, v: ir.Value, lo: int, mask: int) -> ir.Value:
        """(v >> lo) & mask, bytewise."""
        return self.b.and_(self._shift_to(v, -lo), vconst(I8, [mask] * v.type.count))

    def run(self, bp: ir.Value, r: int) -> ir.Value:
        """<32 x i8>: the unsigned quants (q + offset) of values 32r .. 32r+31."""
        raise NotImplementedError

    def scales(self, bp: ir.Value) -> KScales:
        """The super-block's sub-block scales (and minimums) and float factors."""
        raise NotImplementedError

    def weights(self, bp: ir.Value) -> _Weights:
        b = self.b
        u = [concat(b, [self.run(bp, r) for r in c]) for c in self.runs]
        ks = self.scales(bp)
        per_bsum = [BSUM * i // self.sub for i in range(16)]     # the sub-block of each partial sum

        def pairs(r: int) -> list[int]:                           # the sub-block of each pair of run r
            return [(RUN * r + 2 * p) // self.sub for p in range(RUN // 2)]

        scs = [shuffle(b, ks.sc, None, [s for r in c for s in pairs(r)]) for c in self.runs]
        off = mins = None
        if self.offset:
            sc16 = shuffle(b, ks.sc, None, per_bsum)
            off = self._widen16(b.mul(sc16, vconst(I16, [-self.offset] * 16)))
        if self.minimums:
            mins = shuffle(b, ks.m, None, per_bsum)
            f = shuffle(b, ks.f2, None, [0] * 8 + [1] * 8)
        else:
            f = shuffle(b, ks.f2, None, [0] * self.L)
        return _Weights(u, scs, off, mins, f)

    def _widen16(self, v: ir.Value) -> ir.Value:
        """<16 x i16> -> <2L x i16>, zeros above (one register like a chunk's products)."""
        n = 2 * self.L
        return v if n == 16 else shuffle(self.b, v, vconst(I16, [0] * 16), list(range(16)) + [16] * (n - 16))

    def superblock(self, wt: _Weights, j: ir.Value, accs: list[ir.Value], slots: list[KSlot]) -> list[ir.Value]:
        """accs[s] + super-block j of one weight row (unpacked in ``wt``)
        times slot s's row, for every slot, each with the one-row code's
        operations."""
        kb, b, L = self.kb, self.b, self.L
        izero = vconst(I32, [0] * L)
        out = []
        for sl, acc in zip(slots, accs):
            bs = kb.vload(sl.bs, b.mul(j, i64(16)), 16)
            # -offset sc bsum belongs to the same integer sum; m bsum is its own
            s = dpwssd(kb, izero, self._widen16(bs), wt.off) if wt.off is not None else izero
            for c, (u, sc) in enumerate(zip(wt.u, wt.sc)):
                xq = kb.vload(sl.q, b.add(b.mul(j, i64(QK_K)), i64(c * self.CH)), self.CH)
                s = self.chunk_dot(s, u, xq, sc)
            if wt.mins is not None:   # 8 lanes of the sum beside the 8 of sum m bsum: one convert, one FMA
                if L > 8:
                    s = b.add(shuffle(b, s, None, list(range(8))), shuffle(b, s, None, list(range(8, 16))))
                s = shuffle(b, s, maddwd(kb, bs, wt.mins), list(range(16)))
            n = s.type.count
            acc = kb.fma(b.sitofp(s, ir.VectorType(F32, n)), b.fmul(wt.f, kb.splat(kb.load(sl.dx, j), n)), acc)
            out.append(acc)
        return out

    def chunk_dot(self, s: ir.Value, u: ir.Value, xq: ir.Value, sc: ir.Value) -> ir.Value:
        """s + a chunk's products: u (unsigned quants) times xq, each pair of
        values scaled by its sub-block's scale in sc (int32 lanes of 4 values)."""
        return dpwssd(self.kb, s, maddubs(self.kb, u, xq), sc)

    def tile(self, r0: ir.Value, R: int, slots: list[KSlot], ts: list[ir.Value]) -> None:
        """out[ts[s], r0 .. r0+R-1] for the quantized rows in ``slots``
        (token row ``ts[s]``), each slot's sums in the one-row code's order."""
        kb, b, U = self.kb, self.b, self.U
        P = len(slots)
        nmain = self.nb - self.nb % U
        rows = [b.add(r0, i64(i)) for i in range(R)]
        vz = ir.Constant(ir.VectorType(F32, self.A), [0.0] * self.A)

        def at(i: int, u: int, p: int) -> int:
            return (i * U + u) * P + p

        def step(i: int, j: ir.Value, u: int, accs: list[ir.Value]) -> None:
            wt = self.weights(self.block_ptr(rows[i], j))
            new = self.superblock(wt, j, [accs[at(i, u, p)] for p in range(P)], slots)
            for p in range(P):
                accs[at(i, u, p)] = new[p]

        accs = [vz] * (R * U * P)
        if nmain:
            with kb.loop_carry(0, nmain, accs, step=U, name="sblk") as (j, cur, setv):
                cur = list(cur)
                if self.ahead:
                    for i in range(R):
                        kb.prefetch(kb.gep(self.block_ptr(rows[i], j), self.ahead), self.bb * U)
                for i in range(R):
                    for u in range(U):
                        step(i, b.add(j, i64(u)), u, cur)
                setv(cur)
            accs = list(kb.last_carry)
        for jt in range(nmain, self.nb):
            for i in range(R):
                step(i, i64(jt), 0, accs)
        for i in range(R):
            for p in range(P):
                v = accs[at(i, 0, p)]
                for u in range(1, U):   # strict: every slot sums in the one-row code's order
                    v = b.fadd(v, accs[at(i, u, p)])
                kb.store(kb.hsum(v), self.out, b.add(b.mul(ts[p], i64(self.n_out)), rows[i]))


# --- the layouts ------------------------------------------------------------------------------
def _f16s(kb: KernelBuilder, bp: ir.Value, at: int, n: int) -> ir.Value:
    """``n`` float16 at byte ``at`` of the block -> <n x float>."""
    b = kb.b
    h = b.load(b.bitcast(kb.gep(bp, at), ir.PointerType(ir.VectorType(HALF, n))), align=1)
    return b.fpext(h, ir.VectorType(F32, n))


def _d_only(kb: KernelBuilder, bp: ir.Value, at: int) -> ir.Value:
    """<2 x float> (d, 0) from the f16 d at byte ``at``."""
    d = kb.b.extract_element(_f16s(kb, bp, at, 1), i64(0))
    return kb.b.insert_element(vconst(F32, [0.0, 0.0]), d, i64(0))


class _ScaleMin(KQuantIntKernel):
    """Q4_K / Q5_K: f16 d, f16 dmin, eight packed 6-bit (scale, min) pairs,
    sub-blocks of 32."""

    runs_64 = [(0, 2), (1, 3), (4, 6), (5, 7)]

    def scales(self, bp):
        kb, b = self.kb, self.b
        s = self._bytes(bp, self.at("scales"), 16)   # 12 scale bytes + 4 quant bytes (still in the block)
        # s < 4: sc = b[s] & 63, m = b[s+4] & 63
        # s >= 4: sc = b[s+4] & 15 | (b[s-4] >> 6) << 4, m = b[s+4] >> 4 | (b[s] >> 6) << 4
        lo = shuffle(b, s, None, [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11])
        hi = shuffle(b, s, None, [0, 0, 0, 0, 0, 1, 2, 3, 0, 0, 0, 0, 4, 5, 6, 7])
        v = b.or_(b.and_(lo, vconst(I8, [63] * 4 + [15] * 4 + [63] * 4 + [0] * 4)),
                  b.and_(b.lshr(lo, vconst(I8, [4] * 16)), vconst(I8, [0] * 12 + [15] * 4)))
        v = b.or_(v, b.and_(b.lshr(hi, vconst(I8, [2] * 16)), vconst(I8, ([0] * 4 + [0x30] * 4) * 2)))
        v = b.zext(v, ir.VectorType(I16, 16))
        f2 = b.fmul(_f16s(kb, bp, self.at("d"), 2), vconst(F32, [1.0, -1.0]))   # d, dmin
        return KScales(shuffle(b, v, None, list(range(8))), shuffle(b, v, None, list(range(8, 16))), f2)

    def _nibbles(self, bp: ir.Value, at: int, r: int) -> ir.Value:
        """Run r's nibbles: the low (r even) or high nibble of 32 bytes at at + 32 (r // 2)."""
        q = self._bytes(bp, at + 32 * (r // 2))
        return self._bits(q, 4, 15) if r % 2 else self._bits(q, 0, 15)


class Q4KInt(_ScaleMin):
    """d, dmin, 12 scale bytes, 128 bytes of nibbles."""

    def run(self, bp, r):
        return self._nibbles(bp, self.at("qs"), r)


class Q5KInt(_ScaleMin):
    """As Q4_K with 32 bytes of fifth bits (bit r of byte l for value 32r + l)."""

    def run(self, bp, r):
        qh = self._shift_to(self._bytes(bp, self.at("qh")), 4 - r)                 # bit r -> bit 4
        return self.b.or_(self._nibbles(bp, self.at("qs"), r), self.b.and_(qh, vconst(I8, [16] * RUN)))


class Q6KInt(KQuantIntKernel):
    """128 bytes of low nibbles, 64 of high 2-bit parts, 16 int8 scales, f16 d."""

    runs_64 = [(0, 1), (2, 3), (4, 5), (6, 7)]

    def run(self, bp, r):
        b = self.b
        h, i = divmod(r, 4)
        ql = self._bytes(bp, self.at("ql") + 64 * h + 32 * (i % 2))
        ql = self._bits(ql, 4, 15) if i >= 2 else self._bits(ql, 0, 15)
        qh = self._shift_to(self._bytes(bp, self.at("qh") + 32 * h), 4 - 2 * i)   # bits 2i, 2i+1 -> 4, 5
        return b.or_(ql, b.and_(qh, vconst(I8, [0x30] * RUN)))

    def scales(self, bp):
        sc = self.b.sext(self._bytes(bp, self.at("scales"), 16), ir.VectorType(I16, 16))
        return KScales(sc, None, _d_only(self.kb, bp, self.at("d")))


#: Q2_K / Q3_K: one shift of the 64 bytes of 2-bit fields gives runs i and 4 + i
_RUNS_2BIT = [(0, 4), (1, 5), (2, 6), (3, 7)]


class Q2KInt(KQuantIntKernel):
    """16 bytes (scale | min << 4) per 16 values, 64 bytes of 2-bit quants
    (value 128h + 32i + l: bits 2i, 2i+1 of quant byte 32h + l), f16 d, f16 dmin."""

    runs_64 = _RUNS_2BIT

    def run(self, bp, r):
        h, i = divmod(r, 4)
        return self._bits(self._bytes(bp, self.at("qs") + 32 * h), 2 * i, 3)

    def scales(self, bp):
        b = self.b
        s = self._bytes(bp, self.at("scales"), 16)
        v16 = ir.VectorType(I16, 16)
        f2 = b.fmul(_f16s(self.kb, bp, self.at("d"), 2), vconst(F32, [1.0, -1.0]))   # d, dmin
        return KScales(b.zext(self._bits(s, 0, 15), v16), b.zext(self._bits(s, 4, 15), v16), f2)


class Q3KInt(KQuantIntKernel):
    """32 bytes of high bits (bit r of byte l for value 32r + l), 64 bytes of
    2-bit low parts (as Q2_K's), 12 bytes of packed 6-bit scales, f16 d. The
    quant is low + 4 hbit - 4: unsigned, low | hbit << 2 (offset 4)."""

    runs_64 = _RUNS_2BIT

    def run(self, bp, r):
        h, i = divmod(r, 4)
        low = self._bits(self._bytes(bp, self.at("qs") + 32 * h), 2 * i, 3)
        hb = self.b.and_(self._shift_to(self._bytes(bp, self.at("hmask")), 2 - r), vconst(I8, [4] * RUN))   # bit r -> bit 2
        return self.b.or_(low, hb)

    def scales(self, bp):
        sc = q3k_scales(self.b, self._bytes(bp, q3k_scales_at(self.qt), 16))
        return KScales(sc, None, _d_only(self.kb, bp, self.at("d")))
