"""The integer path of ``qmatmul`` on K-quant weights (``act="q8k"``: GGUF
Q4_K, Q5_K, Q6_K), as llama.cpp's ``ggml_vec_dot_q*_K_q8_K``.

The numbers are ``ir.int_kquants.qmatmul_q8k_ref``: x is quantized per
256 values (Q8_K: float32 d_x, int8 q_x, per-16 sums of q_x) and each
super-block adds d_w d_x * (integer sum over sub-blocks of sc * q_w . q_x)
- dmin_w d_x * (integer sum of m * bsum). The integer parts are exact, so
the kernel differs from the reference only in float32 rounding.

Scheduling is ``k_matmul_int``'s (``emit_int_matvec`` drives this class
through ``slot`` / ``quantize`` / ``tile``): each thread quantizes the
rows it needs into its scratch, ``decode_rows`` rows at a time, then reads
each weight super-block once, unpacks it once, and multiplies it with every
quantized row of the group, each row with the one-row code's operations in
its order (bit for bit the decode step's result).

Per super-block and weight row (shared by the rows of a group):

* quants made unsigned bytes (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63, the
  stored u = q + 32), in chunks of CH = 64 values at vector width 16 (one
  512-bit register), else 32. A chunk is a few runs of 32 values that the
  same byte operations produce (Q4_K: the low nibbles of 64 stored bytes
  are runs 0 and 2); the activation slot stores x's runs in that order, so
  the nibbles need no shuffle (Q5_K's and Q6_K's high bits are two 32-byte
  pieces, shifted apart, then joined);
* the sub-block scales as 16-bit lanes, one per pair of values of the chunk.

Per row of the group: ``vpmaddubsw`` (unsigned weight bytes times signed
activation bytes, adjacent pairs summed to int16: at most 2 * 63 * 127,
never saturating) then ``vpmaddwd`` by the scale lanes, added to an int32
accumulator (``vpdpwssd`` on VNNI hosts): two or three instructions per 64
values. The sub-block minimums (Q4_K, Q5_K) are one ``vpmaddwd`` of the 16
activation partial sums by the mins (each twice); Q6_K's -32 bias is one
``vpdpwssd`` of the same sums by -32 sc into the integer sum. Then the
int32 lanes are converted once per super-block and multiplied into float
accumulators with d_w d_x (Q4_K, Q5_K: the sum's lanes folded to 8, beside
the 8 lanes of the minimums' sum, so that one convert and one FMA with
d_w d_x x8, -dmin_w d_x x8 do both); one horizontal sum per row at the end.

Without the x86 instructions (other targets; tests force it) the same
int16 and int32 lanes come from portable widening multiplies: exact, the
same integers, slower.
"""
from __future__ import annotations

from typing import NamedTuple

import llvmlite.ir as ir

from .emit import F32, FAST, I32, KernelBuilder, i64
from .k_matmul import HALF, PREFETCH_BYTES, _tuned, out_rows
from .kernels import KernelSig
from .target import host_target

QK_K = 256
RUN = 32
I8 = ir.IntType(8)
I16 = ir.IntType(16)
#: layout -> bytes per super-block
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
#: layout -> the runs of 32 values in each 64-value chunk (vector width 16):
#: runs one byte operation on 64 consecutive stored bytes produces
RUNS_64 = {"Q4_K": [(0, 2), (1, 3), (4, 6), (5, 7)], "Q5_K": [(0, 2), (1, 3), (4, 6), (5, 7)],
           "Q6_K": [(0, 1), (2, 3), (4, 5), (6, 7)]}
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


def chunk_runs(layout: str, vw: int) -> list[tuple[int, ...]]:
    """The runs of 32 values of each chunk, in the order the slot stores them."""
    return RUNS_64[layout] if vw >= 16 else [(r,) for r in range(QK_K // RUN)]


def _x86_names(nbytes: int) -> tuple[str, str, str | None] | None:
    """(maddubs, maddwd, VNNI dpwssd or None) intrinsics for ``nbytes``-byte
    operands, if the host has them."""
    t = host_target()
    if not t.triple.startswith("x86_64"):
        return None
    if nbytes == 64 and t.has("avx512bw"):
        dp = "llvm.x86.avx512.vpdpwssd.512" if t.has("avx512vnni") else None
        return "llvm.x86.avx512.pmaddubs.w.512", "llvm.x86.avx512.pmaddw.d.512", dp
    if nbytes == 32 and t.has("avx2"):
        vnni = (t.has("avx512vnni") and t.has("avx512vl")) or t.has("avxvnni")
        return "llvm.x86.avx2.pmadd.ub.sw", "llvm.x86.avx2.pmadd.wd", ("llvm.x86.avx512.vpdpwssd.256" if vnni else None)
    return None


def _vc(t: ir.Type, values: list) -> ir.Constant:
    return ir.Constant(ir.VectorType(t, len(values)), values)


def _shuffle(b: ir.IRBuilder, x: ir.Value, y: ir.Value | None, idx: list[int]) -> ir.Value:
    return b.shuffle_vector(x, y if y is not None else ir.Constant(x.type, ir.Undefined), _vc(I32, idx))


def _concat(b: ir.IRBuilder, parts: list[ir.Value]) -> ir.Value:
    while len(parts) > 1:
        n = parts[0].type.count
        parts = [_shuffle(b, parts[i], parts[i + 1], list(range(2 * n))) for i in range(0, len(parts), 2)]
    return parts[0]


def _call(kb: KernelBuilder, name: str, ret: ir.Type, args: list[ir.Value]) -> ir.Value:
    fn = kb.module.globals.get(name)
    if fn is None:
        fn = ir.Function(kb.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return kb.b.call(fn, args)


def _pairs(b: ir.IRBuilder, v: ir.Value) -> ir.Value:
    """Adjacent lanes of ``v`` summed (n lanes -> n/2)."""
    n = v.type.count
    return b.add(_shuffle(b, v, None, list(range(0, n, 2))), _shuffle(b, v, None, list(range(1, n, 2))))


def maddubs(kb: KernelBuilder, u: ir.Value, x: ir.Value) -> ir.Value:
    """<n x i8> unsigned u, signed x -> <n/2 x i16>: u[2i] x[2i] + u[2i+1] x[2i+1]
    (exact for the K-quants' ranges: never saturates)."""
    b, n = kb.b, u.type.count
    names = _x86_names(n)
    if names:
        return _call(kb, names[0], ir.VectorType(I16, n // 2), [u, x])
    v16 = ir.VectorType(I16, n)
    return _pairs(b, b.mul(b.zext(u, v16), b.sext(x, v16)))


def maddwd(kb: KernelBuilder, a: ir.Value, s: ir.Value) -> ir.Value:
    """<2n x i16> a, s -> <n x i32>: a[2i] s[2i] + a[2i+1] s[2i+1]."""
    b, n = kb.b, a.type.count
    names = _x86_names(2 * n)
    if names:
        return _call(kb, names[1], ir.VectorType(I32, n // 2), [a, s])
    v32 = ir.VectorType(I32, n)
    return _pairs(b, b.mul(b.sext(a, v32), b.sext(s, v32)))


def dpwssd(kb: KernelBuilder, acc: ir.Value, a: ir.Value, s: ir.Value) -> ir.Value:
    """acc + maddwd(a, s): ``vpdpwssd`` on VNNI hosts (LLVM may still split
    one into ``vpmaddwd`` + ``vpaddd`` where that shortens a dependency chain)."""
    names = _x86_names(2 * a.type.count)
    if names and names[2]:
        return _call(kb, names[2], acc.type, [acc, a, s])
    return kb.b.add(acc, maddwd(kb, a, s))


def quantize_q8k_block(kb: KernelBuilder, at: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value]:
    """The 256 values of x (input 0) at float index ``at`` as a Q8_K block
    (``ir.int_kquants.quantize_q8k_rows``): <256 x i8> quants, float32 d_x,
    and the <16 x i16> sums of 16 consecutive quants."""
    b = kb.b
    zero = ir.Constant(F32, 0.0)
    xv = kb.vload(kb.in_f32(0), at, QK_K)
    amax = kb.hmax(kb.intrinsic("llvm.fabs", [xv]))
    pos = b.fcmp_ordered(">", amax, zero)
    iscale = b.select(pos, b.fdiv(ir.Constant(F32, 127.0), amax), zero)
    d = b.select(pos, b.fdiv(ir.Constant(F32, 1.0), iscale), zero)
    r = kb.intrinsic("llvm.roundeven", [b.fmul(xv, kb.splat(iscale, QK_K))])
    q = b.fptosi(r, ir.VectorType(I8, QK_K))
    v = b.sext(q, ir.VectorType(I16, QK_K))
    g = 16
    while g > 1:  # sums of 16 consecutive quants, by halving the groups
        h, n = g // 2, v.type.count
        lo = [grp * g + e for grp in range(n // g) for e in range(h)]
        v = b.add(_shuffle(b, v, None, lo), _shuffle(b, v, None, [i + h for i in lo]))
        g = h
    return q, d, v


class _Weights(NamedTuple):
    """One super-block of one weight row, unpacked for every row of a group."""

    u: list[ir.Value]          # per chunk <CH x i8>: unsigned quants
    sc: list[ir.Value]         # per chunk <CH/2 x i16>: the sub-block scale of each pair
    bias: ir.Value             # mins (Q4_K, Q5_K: <16 x i16>, m[s] twice each) or -32 sc (Q6_K: <2L x i16>)
    f: ir.Value                # float factors: <16 x float> d_w x8, -dmin_w x8 (Q4_K, Q5_K); <L x float> d_w (Q6_K)


class KQuantIntKernel:
    """``slot`` / ``quantize`` / ``tile`` for ``k_matmul_int.emit_int_matvec``."""

    def __init__(self, kb: KernelBuilder, sig: KernelSig) -> None:
        xt, wt = sig.in_types[:2]
        self.layout = wt.layout
        if self.layout not in BLOCK_BYTES:
            raise NotImplementedError(f"q8k matvec on a {self.layout} weight")
        self.kb, self.b = kb, kb.b
        self.n, self.k = int(wt.shape[0]), int(wt.shape[1])
        if self.k % QK_K:
            raise NotImplementedError(f"row length {self.k} is not a multiple of {QK_K}")
        self.nb = self.k // QK_K
        self.bb = BLOCK_BYTES[self.layout]
        self.runs = chunk_runs(self.layout, kb.vw)
        self.CH = RUN * len(self.runs[0])
        self.L = self.CH // 4                  # int32 lanes of a chunk's sums
        self.minimums = self.layout != "Q6_K"  # Q4_K, Q5_K: value = d sc q - dmin m
        self.A = 16 if self.minimums else self.L   # float accumulator lanes
        self.out, self.n_out = out_rows(kb, sig)
        self.U = _tuned(kb, sig.attr, "unroll", _UNROLL)
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
        """Row x[xrow / K] into slot ``sl`` (``ir.int_kquants.quantize_q8k_rows``)."""
        kb, b = self.kb, self.b
        with kb.loop(0, self.nb, name="qblk") as j:
            q, d, v = quantize_q8k_block(kb, b.add(xrow, b.mul(j, i64(QK_K))))
            base = b.mul(j, i64(QK_K))
            for run in range(QK_K // RUN):
                piece = _shuffle(b, q, None, list(range(RUN * run, RUN * run + RUN)))
                kb.vstore(piece, sl.q, b.add(base, i64(RUN * self.pos[run])))
            kb.vstore(v, sl.bs, b.mul(j, i64(16)))
            kb.store(d, sl.dx, j)

    # --- step 2: weights ------------------------------------------------------------------
    def _block_ptr(self, row: ir.Value, j: ir.Value) -> ir.Value:
        b = self.b
        return self.kb.gep(self.w, b.mul(b.add(b.mul(row, i64(self.nb)), j), i64(self.bb)))

    def _bytes(self, bp: ir.Value, at: int, n: int = RUN) -> ir.Value:
        return self.kb.vload(bp, at, n)

    def _shift_to(self, v: ir.Value, sh: int) -> ir.Value:
        """Bytes of v shifted left by sh (right by -sh)."""
        b = self.b
        if sh > 0:
            return b.shl(v, _vc(I8, [sh] * v.type.count))
        if sh < 0:
            return b.lshr(v, _vc(I8, [-sh] * v.type.count))
        return v

    def _run(self, bp: ir.Value, r: int) -> ir.Value:
        """<32 x i8>: the unsigned quants of values 32r .. 32r+31."""
        b = self.b
        lo15 = _vc(I8, [15] * RUN)
        if self.layout == "Q6_K":
            h, i = divmod(r, 4)
            ql = self._bytes(bp, 64 * h + 32 * (i % 2))
            ql = b.lshr(ql, _vc(I8, [4] * RUN)) if i >= 2 else b.and_(ql, lo15)
            qh = self._shift_to(self._bytes(bp, 128 + 32 * h), 4 - 2 * i)   # bits 2i, 2i+1 -> 4, 5
            return b.or_(ql, b.and_(qh, _vc(I8, [0x30] * RUN)))
        at = 16 if self.layout == "Q4_K" else 48
        q = self._bytes(bp, at + 32 * (r // 2))
        q = b.lshr(q, _vc(I8, [4] * RUN)) if r % 2 else b.and_(q, lo15)
        if self.layout == "Q5_K":
            qh = self._shift_to(self._bytes(bp, 16), 4 - r)                 # bit r -> bit 4
            q = b.or_(q, b.and_(qh, _vc(I8, [16] * RUN)))
        return q

    def scales(self, bp: ir.Value) -> tuple[ir.Value, ir.Value]:
        """The super-block's integer sub-block scales as <16 x i16> (Q6_K:
        its 16 scales; Q4_K / Q5_K: 8 scales, then 8 minimums) and its float
        factors <2 x float>: d, and -dmin (Q6_K: 0)."""
        kb, b = self.kb, self.b
        if self.layout == "Q6_K":
            sc = b.sext(self._bytes(bp, 192, 16), ir.VectorType(I16, 16))
            d = b.fpext(b.load(b.bitcast(kb.gep(bp, 208), ir.PointerType(HALF)), align=1), F32)
            return sc, b.insert_element(_vc(F32, [0.0, 0.0]), d, i64(0))
        s = self._bytes(bp, 4, 16)   # 12 scale bytes + 4 quant bytes (still in the block)
        # s < 4: sc = b[s] & 63, m = b[s+4] & 63
        # s >= 4: sc = b[s+4] & 15 | (b[s-4] >> 6) << 4, m = b[s+4] >> 4 | (b[s] >> 6) << 4
        lo = _shuffle(b, s, None, [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11])
        hi = _shuffle(b, s, None, [0, 0, 0, 0, 0, 1, 2, 3, 0, 0, 0, 0, 4, 5, 6, 7])
        v = b.or_(b.and_(lo, _vc(I8, [63] * 4 + [15] * 4 + [63] * 4 + [0] * 4)),
                  b.and_(b.lshr(lo, _vc(I8, [4] * 16)), _vc(I8, [0] * 12 + [15] * 4)))
        v = b.or_(v, b.and_(b.lshr(hi, _vc(I8, [2] * 16)), _vc(I8, ([0] * 4 + [0x30] * 4) * 2)))
        dd = b.fpext(b.load(b.bitcast(bp, ir.PointerType(ir.VectorType(HALF, 2))), align=1), ir.VectorType(F32, 2))
        return b.zext(v, ir.VectorType(I16, 16)), b.fmul(dd, _vc(F32, [1.0, -1.0]))

    def _weights(self, bp: ir.Value) -> _Weights:
        kb, b = self.kb, self.b
        u = [_concat(b, [self._run(bp, r) for r in c]) for c in self.runs]
        sc, f2 = self.scales(bp)
        if self.layout == "Q6_K":
            lanes = [[2 * r] * 8 + [2 * r + 1] * 8 for r in range(8)]
            bias = self._widen16(b.mul(sc, _vc(I16, [-32] * 16)))
            f = _shuffle(b, f2, None, [0] * self.L)
        else:                                               # sc: lanes 0-7 scales, 8-15 mins
            lanes = [[r] * 16 for r in range(8)]
            bias = _shuffle(b, sc, None, [8 + i // 2 for i in range(16)])
            f = _shuffle(b, f2, None, [0] * 8 + [1] * 8)
        scs = [_shuffle(b, sc, None, [i for r in c for i in lanes[r]]) for c in self.runs]
        return _Weights(u, scs, bias, f)

    def _widen16(self, v: ir.Value) -> ir.Value:
        """<16 x i16> -> <2L x i16>, zeros above (one register like a chunk's products)."""
        n = 2 * self.L
        return v if n == 16 else _shuffle(self.b, v, _vc(I16, [0] * 16), list(range(16)) + [16] * (n - 16))

    def _superblock(self, wt: _Weights, j: ir.Value, accs: list[ir.Value], slots: list[KSlot]) -> list[ir.Value]:
        """accs[s] + super-block j of one weight row (unpacked in ``wt``)
        times slot s's row, for every slot, each with the one-row code's
        operations."""
        kb, b, L = self.kb, self.b, self.L
        izero = _vc(I32, [0] * L)
        out = []
        for sl, acc in zip(slots, accs):
            bs = kb.vload(sl.bs, b.mul(j, i64(16)), 16)
            # Q6_K: -32 sc bsum belongs to the same integer sum; Q4_K / Q5_K: m bsum is its own
            s = dpwssd(kb, izero, self._widen16(bs), wt.bias) if self.minimums is False else izero
            for c, (u, sc) in enumerate(zip(wt.u, wt.sc)):
                xq = kb.vload(sl.q, b.add(b.mul(j, i64(QK_K)), i64(c * self.CH)), self.CH)
                s = dpwssd(kb, s, maddubs(kb, u, xq), sc)
            if self.minimums:   # 8 lanes of the sum beside the 8 of sum m bsum: one convert, one FMA
                if L > 8:
                    s = b.add(_shuffle(b, s, None, list(range(8))), _shuffle(b, s, None, list(range(8, 16))))
                s = _shuffle(b, s, maddwd(kb, bs, wt.bias), list(range(16)))
            n = s.type.count
            acc = kb.fma(b.sitofp(s, ir.VectorType(F32, n)), b.fmul(wt.f, kb.splat(kb.load(sl.dx, j), n)), acc)
            out.append(acc)
        return out

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
            wt = self._weights(self._block_ptr(rows[i], j))
            new = self._superblock(wt, j, [accs[at(i, u, p)] for p in range(P)], slots)
            for p in range(P):
                accs[at(i, u, p)] = new[p]

        accs = [vz] * (R * U * P)
        if nmain:
            with kb.loop_carry(0, nmain, accs, step=U, name="sblk") as (j, cur, setv):
                cur = list(cur)
                if self.ahead:
                    for i in range(R):
                        kb.prefetch(kb.gep(self._block_ptr(rows[i], j), self.ahead), self.bb * U)
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
                for u in range(1, U):
                    v = b.fadd(v, accs[at(i, u, p)], flags=FAST)
                kb.store(kb.hsum(v), self.out, b.add(b.mul(ts[p], i64(self.n_out)), rows[i]))
