"""Prefill attention on AMX bf16 tiles: a block of 16 query rows of one head
at a time against key and value blocks, so each key and value is read once
per 16 rows instead of once per row (``k_attention``'s per-row kernel reads
them once per row and sums dot products horizontally: ~40 GFLOP/s).

Per thread, once per KV head it meets (units are kv-head-major): the visible
keys [0, pos + T) of that head are converted to bf16 halves into scratch, keys in
``tdpbf16ps``'s B layout for Q.K^T (per 16 keys and 32 dims: 16 rows of
dim pairs x 16 keys) and values in its B layout for P.V (per 32 keys and 16
dims: 16 rows of key pairs x 16 dims); past pos + T, zeros (whole tiles).
A unit is (kv head, 16-row tile, head of the group), strided over threads:
its work is self-contained, so the results do not depend on the thread
count. Per unit, three passes (the per-row kernel's, on tiles):

1. S = Q.K^T (f32, 16 rows x visible keys) into scratch: Q's 16 rows in
   bf16, per 16 keys one f32 tile accumulating hd / 32 products.
2. per row: s * scale (soft-capped if asked), masked to the row's visible
   keys (causal), max, p = exp(s - max) into scratch as two bf16 halves,
   and the sum of the p.
3. O = P.V: head_dim's 16-column groups four at a time in four f32 tiles
   accumulating over all key blocks (no rescaling: the max is known), then
   out = O / sum per row.

Not an online softmax: S for 16 rows of the longest context fits L2
(16 x 4096 f32 = 256 KB), so the max comes first and P.V accumulates in the
tiles without rescaling.

Accuracy: Q and K are each split into two bf16 halves (hi = bf16(x), lo =
bf16(x - hi): an f16 key exactly, a query to ~2^-17) and S = Qhi.Khi +
Qhi.Klo + Qlo.Khi, so the scores, which the exponential amplifies, are
about as exact as f32's (about 10% more time than one product). P and V are
split the same way (``PV_SPLIT``; one product each would err by a few
2^-9 of the values, below the int8 quantization of the output projection
that follows, but not below the float path's): outputs agree with an f32
reference to ~1e-6. See tests/test_attention_tiled.py. So a prompt's
rows no longer have the bits a decode step of the same row has (the
per-row kernel's): chunks of fewer than MIN_ROWS rows still do.
"""
from __future__ import annotations

import llvmlite.ir as ir

from . import amx
from .emit import F32, I32, I64, KernelBuilder, fconst, i64
from .kernels import KernelSig
from .simd import call

I16 = ir.IntType(16)
HALF = ir.HalfType()
#: rows a call needs for the tiles (fewer: the per-row kernel; a decode step, a speculative check)
MIN_ROWS = 16
#: rows per tile
TR = 16
#: P.V's operands in two bf16 halves too (three tile products, not one): outputs then agree with the
#: f32 reference to ~1e-6 (the interpreter comparisons' 1e-4 hold) instead of a few 2^-9 of the values.
#: CPU time of one call, 128 rows at 3,500 positions (Qwen2.5 shape, 1 thread, alternated): 12.5, 15.5,
#: 11.9 ms split; 7.6, 10.8, 11.1 ms not; the per-row kernel 24.6 ms
PV_SPLIT = True
#: the kernel attribute ``tiled``'s default: off. A model's prompt graphs set it with
#: ``tiled_from`` = ``compiler.driver.FROM_POSITION`` (``attention_tiles``; ``LMC_ATTN_TILED=0``: not):
#: rows before that position keep the per-row kernel's bits, the decode step's, which the integer
#: path keeps for every row (tests/test_repack.py::test_one_arithmetic_for_every_row_count); rows
#: from it on take the tiles. Tiles on every row of a chunk, Qwen2.5-Coder's 3,500-token prompt
#: prefilled at 101% of its 128-token rate (lmc bench, Emerald Rapids, 2 threads; per-row kernel:
#: attention 43.9% of that prefill, tiled 16.6%)
DEFAULT = 0


def supported(sig: KernelSig, kind: str) -> bool:
    """Shapes the tiled kernel takes: an f16 contiguous cache (the default;
    an f32 cache, asked for to reproduce float references, keeps the per-row
    kernel's f32 arithmetic), no
    window (nor a ring), head_dim a multiple of 32, a call that may have
    MIN_ROWS rows. (A window's keys before a row's first visible one are
    converted too, and a value there, NaN in a test's cache, would reach
    every row's P.V through a zero weight: 0 * NaN.)"""
    a = sig.attr
    hd = int(a["head_dim"])
    rows = sig.in_types[0].shape[0] if sig.in_types[0].rank == 2 else 1
    many = not isinstance(rows, int) or rows >= MIN_ROWS
    return (kind == "f16" and hd % 32 == 0 and not a.get("ring") and not int(a.get("window", 0) or 0)
            and many)


def usable(kb: KernelBuilder, sig: KernelSig, kind: str) -> bool:
    """Tiles for this attention: the target has AMX bf16 (and the process
    the tile state) and the kernel attribute ``tiled`` (0 or 1, default ``DEFAULT``)
    does not say no."""
    if not (kb.target.amx and kb.target.has("amx-bf16") and supported(sig, kind)):
        return False
    return bool(int(sig.attr.get("tiled", DEFAULT)))


def _pad(n: int, m: int) -> int:
    return -(-n // m) * m


def _rows(NP: int) -> tuple[int, int]:
    """Row strides (elements) of S (f32) and P (bf16) for NP keys: one cache
    line past NP's, so that a tile's 16 rows do not all fall in one L1 set
    (NP a multiple of 32: 4 KiB-multiple strides at NP = 1024, 2048, 4096)."""
    return NP + 16, NP + 32


def scratch_bytes(sig: KernelSig) -> int:
    """Keys and values of one KV head in bf16 (cache rows rounded up to 32),
    S (f32) and P (bf16) of 16 rows, Q (bf16) and O (f32) of 16 rows, sums."""
    hd = int(sig.attr["head_dim"])
    NP = _pad(int(sig.in_types[1].shape[0]), 32)
    SP, PP = _rows(NP)
    halves = 2 if PV_SPLIT else 1
    return (2 + halves) * NP * hd * 2 + TR * SP * 4 + halves * TR * PP * 2 + 2 * TR * hd * 2 + TR * hd * 4 + 64 + 64 * 8


def _bf16(kb: KernelBuilder, v: ir.Value) -> ir.Value:
    """<n x float> -> <n x i16>: bfloat16 bits, rounded to nearest even."""
    b = kb.b
    n = v.type.count
    it = ir.VectorType(I32, n)
    bits = b.bitcast(v, it)
    c = lambda x: ir.Constant(it, [x] * n)  # noqa: E731
    lsb = b.and_(b.lshr(bits, c(16)), c(1))
    r = b.lshr(b.add(b.add(bits, c(0x7FFF)), lsb), c(16))
    return b.trunc(r, ir.VectorType(I16, n))


def _split(kb: KernelBuilder, v: ir.Value) -> tuple[ir.Value, ir.Value]:
    """<n x float> -> bf16 (hi, lo) with hi + lo = v to ~2^-17 relative
    (an f16 value exactly: its 11 significant bits fit 8 + 8)."""
    hi = _bf16(kb, v)
    return hi, _bf16(kb, kb.b.fsub(v, _f32_of_bf16(kb, hi)))


def _f32_of_bf16(kb: KernelBuilder, h: ir.Value) -> ir.Value:
    b = kb.b
    n = h.type.count
    it = ir.VectorType(I32, n)
    return b.bitcast(b.shl(b.zext(h, it), ir.Constant(it, [16] * n)), ir.VectorType(F32, n))


def _exp_neg(kb: KernelBuilder, x: ir.Value) -> ir.Value:
    """exp(x) for x <= 0 (<16 x float>), to about 2e-6 relative: enough for a
    weight rounded to bf16 next (2^-9), and cheaper than ``exp_poly``:
    x log2(e) = n + f, |f| <= 1/2, 2^f by its degree-5 Taylor polynomial,
    2^n into the exponent. Below -87 (weights < 1.6e-38): about 1.6e-38."""
    b = kb.b
    w = x.type.count
    c = lambda v: fconst(v, w)  # noqa: E731
    t = b.fmul(kb.intrinsic("llvm.maxnum", [x, c(-87.0)]), c(1.4426950408889634))
    n = kb.intrinsic("llvm.roundeven", [t])
    f = b.fsub(t, n)
    p = c(1.3333558146428443e-3)
    for k in (9.618129107628477e-3, 5.550410866482158e-2, 0.2402265069591007, 0.6931471805599453, 1.0):
        p = kb.mul_add(p, f, c(k))
    it = ir.VectorType(I32, w)
    bits = b.shl(b.add(b.fptosi(n, it), ir.Constant(it, [127] * w)), ir.Constant(it, [23] * w))
    return b.fmul(p, b.bitcast(bits, x.type))


def _dp(kb: KernelBuilder, c: ir.Value, a: ir.Value, bt: ir.Value) -> ir.Value:
    """C (16 x 16 f32) += A (16 x 32 bf16) . B (16 rows of 16 bf16 pairs): ``tdpbf16ps``."""
    s16 = lambda v: ir.Constant(I16, v)  # noqa: E731
    return call(kb, "llvm.x86.tdpbf16ps.internal", amx.TILE, [s16(16), s16(64), s16(64), c, a, bt])


def emit_tiled(kb: KernelBuilder, sig: KernelSig, kind: str) -> None:
    """The tiled kernel's code (the caller branches to it when T >= MIN_ROWS, or for a model's
    prompt rows from ``tiled_from`` on, however few: a row's result does not depend on the
    other rows of its tile)."""
    b = kb.b
    a = sig.attr
    H, KVH, hd = int(a["n_heads"]), int(a["n_kv_heads"]), int(a["head_dim"])
    group = H // KVH
    scale = float(a["scale"])
    cap = float(a.get("softcap", 0.0) or 0.0)
    stride = KVH * hd
    NP = _pad(int(sig.in_types[1].shape[0]), 32)
    nchunk, ngrp = hd // 32, hd // 16      # 32-dim chunks (Q.K^T), 16-dim groups (P.V)

    # scratch layout (bytes; every part a multiple of 64)
    i8p = ir.PointerType(ir.IntType(8))
    base = b.bitcast(kb.scratch, i8p)
    off = 0

    def part(nbytes: int) -> ir.Value:
        nonlocal off
        p = kb.gep(base, off)
        off += _pad(nbytes, 64)
        return p
    kbuf = part(NP * hd * 2)
    klo = part(NP * hd * 2)
    vbuf = part(NP * hd * 2)
    vlo = part(NP * hd * 2) if PV_SPLIT else None
    SP, PP = _rows(NP)
    sbuf = part(TR * SP * 4)
    pbuf = part(TR * PP * 2)
    plo = part(TR * PP * 2) if PV_SPLIT else None
    qbuf = part(TR * hd * 2)
    qlo = part(TR * hd * 2)
    obuf = part(TR * hd * 4)
    sums = b.bitcast(part(TR * 4), ir.PointerType(F32))
    s_f = b.bitcast(sbuf, ir.PointerType(F32))
    p_h = b.bitcast(pbuf, ir.PointerType(I16))
    p_l = b.bitcast(plo, ir.PointerType(I16)) if PV_SPLIT else None
    q_h = b.bitcast(qbuf, ir.PointerType(I16))
    q_l = b.bitcast(qlo, ir.PointerType(I16))
    o_f = b.bitcast(obuf, ir.PointerType(F32))
    vb16 = b.bitcast(vbuf, ir.PointerType(I16))
    vl16 = b.bitcast(vlo, ir.PointerType(I16)) if PV_SPLIT else None
    kb32 = b.bitcast(kbuf, ir.PointerType(I32))
    kl32 = b.bitcast(klo, ir.PointerType(I32))

    q = kb.in_f32(0)
    out = kb.out_f32()
    if kind == "f32":
        kc, vc = kb.in_f32(1), kb.in_f32(2)
    else:
        kc = b.bitcast(kb.in_raw[1], ir.PointerType(HALF))
        vc = b.bitcast(kb.in_raw[2], ir.PointerType(HALF))

    def load_f(p: ir.Value, idx: ir.Value | int, w: int) -> ir.Value:
        v = kb.vload(p, idx, w)
        return v if kind == "f32" else b.fpext(v, ir.VectorType(F32, w))

    T = kb.rows_of(sig.in_types[0].shape)
    ntot = b.add(kb.pos, T)                         # keys the last row sees
    npad = b.and_(b.add(ntot, i64(31)), i64(-32))   # converted: whole 32-key blocks
    last = b.sub(ntot, i64(1))
    ntiles = b.sdiv(b.add(T, i64(TR - 1)), i64(TR))
    per_kv = b.mul(ntiles, i64(group))
    units = b.mul(per_kv, i64(KVH))
    cur = b.alloca(I64)
    b.store(i64(-1), cur)
    zero16h = ir.Constant(ir.VectorType(I16, 16), [0] * 16)
    iota16 = ir.Constant(ir.VectorType(I64, 16), list(range(16)))

    def convert(g: ir.Value) -> None:
        """KV head g's keys and values [0, npad) into kbuf, vbuf (bf16 tiles)."""
        col = b.mul(g, i64(hd))
        with kb.loop(0, npad, name="ck") as j:      # keys: a transposed tile per 16 keys x 32 dims
            real = b.icmp_signed("<", j, ntot)
            row = b.add(b.mul(kb.imin(j, last), i64(stride)), col)
            blk, jn = b.sdiv(j, i64(16)), b.and_(j, i64(15))
            for c in range(nchunk):
                x = load_f(kc, b.add(row, i64(32 * c)), 32)
                h, lo = _split(kb, x)
                t0 = b.add(b.mul(b.add(b.mul(blk, i64(nchunk)), i64(c)), i64(256)), jn)   # i32 index
                for part_, dst in ((h, kb32), (lo, kl32)):
                    part_ = b.select(real, part_, ir.Constant(part_.type, [0] * 32))
                    w = b.bitcast(part_, ir.VectorType(I32, 16))
                    for r in range(16):
                        kb.store(b.extract_element(w, i64(r)), dst, b.add(t0, i64(16 * r)))
        with kb.loop(0, npad, step=2, name="cv") as j:   # values: key pairs interleaved per 16 dims
            blk, rp = b.sdiv(j, i64(32)), b.sdiv(b.and_(j, i64(31)), i64(2))
            vs = []
            for e in range(2):
                je = b.add(j, i64(e))
                real = b.icmp_signed("<", je, ntot)
                row = b.add(b.mul(kb.imin(je, last), i64(stride)), col)
                vs.append((real, row))
            for d in range(ngrp):
                hs, ls = [], []
                for real, row in vs:
                    h, lo = _split(kb, load_f(vc, b.add(row, i64(16 * d)), 16))
                    hs.append(b.select(real, h, zero16h))
                    ls.append(b.select(real, lo, zero16h))
                t0 = b.add(b.mul(b.add(b.mul(blk, i64(ngrp)), i64(d)), i64(512)), b.mul(rp, i64(32)))
                for pair, dst in ((hs, vb16), (ls, vl16)) if PV_SPLIT else ((hs, vb16),):
                    il = b.shuffle_vector(pair[0], pair[1], ir.Constant(
                        ir.VectorType(I32, 32), [k // 2 + (16 if k % 2 else 0) for k in range(32)]))
                    kb.vstore(il, dst, t0)


    def scaled(v: ir.Value) -> ir.Value:
        """Scores (a float or 16) times the scale, soft-capped if the op says so."""
        w = v.type.count if isinstance(v.type, ir.VectorType) else None
        v = b.fmul(v, fconst(scale, w))
        if cap:
            v = b.fmul(kb.tanh(b.fmul(v, fconst(1.0 / cap, w))), fconst(cap, w))
        return v
    ninf = fconst(float("-inf"), 16)
    with kb.loop(kb.tid, units, step=kb.nthreads, name="tu") as u:
        g = b.sdiv(u, per_kv)
        rem = b.srem(u, per_kv)
        t0 = b.mul(b.sdiv(rem, i64(group)), i64(TR))
        h = b.add(b.mul(g, i64(group)), b.srem(rem, i64(group)))
        with kb.if_then(b.icmp_signed("!=", b.load(cur), g)):
            convert(g)
            b.store(g, cur)
        # Q's 16 rows (rows past T: zeros) in bf16
        for r in range(TR):
            t = b.add(t0, i64(r))
            real = b.icmp_signed("<", t, T)
            qrow = b.mul(b.add(b.mul(kb.imin(t, b.sub(T, i64(1))), i64(H)), h), i64(hd))
            for c in range(ngrp):
                hv, lv = _split(kb, kb.vload(q, b.add(qrow, i64(16 * c)), 16))
                kb.vstore(b.select(real, hv, zero16h), q_h, r * hd + 16 * c)
                kb.vstore(b.select(real, lv, zero16h), q_l, r * hd + 16 * c)
        tend = kb.imin(b.add(t0, i64(TR)), T)
        jhi = b.and_(b.add(b.add(kb.pos, tend), i64(31)), i64(-32))     # keys of the tile, whole 32s
        jlo = i64(0)

        # pass 1: S = Q.K^T, two 16-key blocks at a time (two accumulators in flight)
        # (hi, lo) halves: Q.K = Qhi.Khi + Qhi.Klo + Qlo.Khi, the dropped Qlo.Klo ~2^-16 relative
        def q_tile(buf: ir.Value, c: int) -> ir.Value:
            return amx.tile_load(kb, 16, 64, kb.gep(buf, 64 * c), hd * 2)
        qa = [(q_tile(qbuf, c), q_tile(qlo, c)) for c in range(nchunk)] if nchunk <= 2 else None
        with kb.loop(jlo, jhi, step=32, name="qk") as j:
            cs = [amx.tile_zero(kb, 16, 64) for _ in range(2)]
            for c in range(nchunk):
                ah, al = qa[c] if qa else (q_tile(qbuf, c), q_tile(qlo, c))
                for e in range(2):
                    blk = b.add(b.sdiv(j, i64(16)), i64(e))
                    at_ = b.mul(b.add(b.mul(blk, i64(nchunk)), i64(c)), i64(1024))
                    bl = amx.tile_load(kb, 16, 64, kb.gep(klo, at_), 64)
                    cs[e] = _dp(kb, cs[e], ah, bl)
                    bh = amx.tile_load(kb, 16, 64, kb.gep(kbuf, at_), 64)
                    cs[e] = _dp(kb, cs[e], al, bh)
                    cs[e] = _dp(kb, cs[e], ah, bh)
            for e in range(2):
                amx.tile_store(kb, 16, 64, kb.gep(sbuf, b.mul(b.add(j, i64(16 * e)), i64(4))), SP * 4, cs[e])

        # pass 2: per row, max, p = exp(s - max) rounded to bf16, the sum of the rounded p.
        # Keys below the row's diagonal block unmasked; from it to jhi (<= 3 blocks) masked.
        # The max of the raw scores: the scale (> 0) and the soft cap keep the order.
        for r in range(TR):
            t = b.add(t0, i64(r))
            with kb.if_then(b.icmp_signed("<", t, T)):
                e_ = b.add(b.add(kb.pos, t), i64(1))   # the row sees keys [0, e_)
                full = b.and_(e_, i64(-16))
                srow = kb.gep(s_f, r * SP)

                def masked(j: ir.Value, v: ir.Value, other: ir.Value) -> ir.Value:
                    ok = b.icmp_signed("<", b.add(kb.splat(j, 16), iota16), kb.splat(e_, 16))
                    return b.select(ok, v, other)
                with kb.loop_carry(jlo, full, [ninf], step=16, name="mx") as (j, (m,), setv):
                    setv([kb.fmax(m, kb.vload(srow, j, 16))])
                with kb.loop_carry(full, jhi, kb.last_carry, step=16, name="mxt") as (j, (m,), setv):
                    setv([kb.fmax(m, masked(j, kb.vload(srow, j, 16), ninf))])
                mx = kb.splat(scaled(kb.hmax(kb.last_carry[0])), 16)

                def weights(j: ir.Value, sm: ir.Value, mask: bool) -> ir.Value:
                    p = _exp_neg(kb, b.fsub(scaled(kb.vload(srow, j, 16)), mx))
                    if mask:
                        p = masked(j, p, fconst(0.0, 16))
                    if PV_SPLIT:   # the weights' sum is theirs (hi + lo = p to ~2^-17)
                        ph, pl = _split(kb, p)
                        kb.vstore(pl, p_l, b.add(i64(r * PP), j))
                        kb.vstore(ph, p_h, b.add(i64(r * PP), j))
                        return b.fadd(sm, p)
                    ph = _bf16(kb, p)   # the sum of the rounded weights the products use
                    kb.vstore(ph, p_h, b.add(i64(r * PP), j))
                    return b.fadd(sm, _f32_of_bf16(kb, ph))
                with kb.loop_carry(jlo, full, [fconst(0.0, 16)], step=16, name="ex") as (j, (sm,), setv):
                    setv([weights(j, sm, False)])
                with kb.loop_carry(full, jhi, kb.last_carry, step=16, name="ext") as (j, (sm,), setv):
                    setv([weights(j, sm, True)])
                kb.store(kb.hsum(kb.last_carry[0]), sums, r)

        # pass 3: O = P.V, four 16-column groups at a time, then out = O / sum
        for d0 in range(0, ngrp, 4):
            nd = min(4, ngrp - d0)
            with kb.loop_carry(jlo, jhi, [amx.tile_zero(kb, 16, 64) for _ in range(nd)], step=32, name="pv") as (j, cs, setv):
                ah = amx.tile_load(kb, 16, 64, kb.gep(pbuf, b.mul(j, i64(2))), PP * 2)
                al = amx.tile_load(kb, 16, 64, kb.gep(plo, b.mul(j, i64(2))), PP * 2) if PV_SPLIT else None
                blk = b.sdiv(j, i64(32))
                new = []
                for d in range(nd):   # P.V, or Ph.Vl + Pl.Vh + Ph.Vh
                    at_ = b.mul(b.add(b.mul(blk, i64(ngrp)), i64(d0 + d)), i64(1024))
                    c = cs[d]
                    if PV_SPLIT:
                        c = _dp(kb, c, ah, amx.tile_load(kb, 16, 64, kb.gep(vlo, at_), 64))
                    bh = amx.tile_load(kb, 16, 64, kb.gep(vbuf, at_), 64)
                    if PV_SPLIT:
                        c = _dp(kb, c, al, bh)
                    new.append(_dp(kb, c, ah, bh))
                setv(new)
            for d, c in enumerate(kb.last_carry):
                amx.tile_store(kb, 16, 64, kb.gep(obuf, (d0 + d) * 64), hd * 4, c)
        for r in range(TR):
            t = b.add(t0, i64(r))
            with kb.if_then(b.icmp_signed("<", t, T)):
                inv = kb.splat(b.fdiv(fconst(1.0), kb.load(sums, r)), 16)
                orow = b.mul(b.add(b.mul(t, i64(H)), h), i64(hd))
                for c in range(ngrp):
                    kb.vstore(b.fmul(kb.vload(o_f, r * hd + 16 * c, 16), inv), out, b.add(orow, i64(16 * c)))
