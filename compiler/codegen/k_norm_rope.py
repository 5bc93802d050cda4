"""Row-wise kernels: rmsnorm, layernorm, rope, take_last, take_rows, kv_write, kv_write_paged,
rope_kv_write(_paged) (rope's rotation stored straight into the cache).

rmsnorm and rope split "units" (rows, or rows x chunks/heads) between threads;
take_last and kv_write are copies split by elements (kv_write_paged: by
vectors or blocks, each row to its own pool row, ``paging.PagedRows``).
rope takes a scalar position (row t at pos + t) or one per row (a batch). Constant lengths are
covered with explicit vectors whose width divides the length (see
``pow2_divisor``), so there is no scalar tail to get wrong. rmsnorm's number
of sum-of-squares accumulators comes from the row length unless the kernel
attribute ``unroll`` sets it (``lmc kernel``).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

import llvmlite.ir as ir

from ir.kv_lowbit import GROUP, LowBit, lowbit
from ir.rope_tables import rope_base_freqs, rope_mix

from . import kv_lowbit as lb_emit
from .emit import F32, KernelBuilder, const_f32_array, f32c, fconst, hsum_many, i64, memcpy, pow2_divisor
from .act_quant import quantize_q8_block
from .kernels import KernelSig, kernel
from .paging import PagedRows, RowPositions
from .simd import concat


def scratch_floats(sig: KernelSig) -> int:
    """Per-thread scratch (float32 elements) a kernel of ``sig`` needs:
    rope keeps a cos/sin table of ``head_dim`` floats; rope_kv_write into a
    q8 cache also the rotated head it quantizes; the others need none."""
    if sig.op == "rope":
        return int(sig.attr["head_dim"])
    if sig.op in ("rope_kv_write", "rope_kv_write_paged"):
        q8 = sig.in_types[0].layout is not None   # q8, q4, q2: the rotated head, quantized from scratch
        return max(int(sig.attr["head_dim"]), _rope_table_floats(sig) + (int(sig.attr["head_dim"]) if q8 else 0))
    return 0


def _check_f32(t, what: str) -> None:
    if t.dtype != "f32" or (t.layout or "F32") != "F32":
        raise NotImplementedError(f"{what}: native kernel needs f32 data, got {t}")


def weight_loader(kb: KernelBuilder, t, raw: ir.Value) -> Callable[[ir.Value, int], ir.Value]:
    """load(idx, width) for a 1-D weight stored as F32 or F16 (widened)."""
    layout = t.layout or "F32"
    if layout == "F32" and t.dtype in ("f32",):
        p = kb.fptr(raw)
        return lambda idx, w: kb.vload(p, idx, w)
    if layout == "F16" or t.dtype == "f16":
        hp = kb.b.bitcast(raw, ir.PointerType(ir.HalfType()))
        return lambda idx, w: kb.b.fpext(kb.vload(hp, idx, w), ir.VectorType(F32, w))
    raise NotImplementedError(f"rmsnorm: weight layout {layout} (dequantize it first)")


# --- rmsnorm ------------------------------------------------------------------------
def rmsnorm_unroll(m: int, vw: int) -> int:
    """Sum-of-squares accumulators for a row of ``m`` at vector width ``vw``."""
    nv = m // pow2_divisor(m, vw)
    return 4 if nv >= 8 and nv % 4 == 0 else (2 if nv >= 4 and nv % 2 == 0 else 1)


def emit_rmsnorm_row(kb: KernelBuilder, xr: ir.Value, orow: ir.Value, wload: Callable[[ir.Value, int], ir.Value],
                     m: int, eps: float, unroll: int | None = None) -> None:
    """One chunk of ``m`` floats at xr, normalized and scaled by the weight,
    to orow. The rmsnorm kernel and the matmuls that fuse it
    (``passes/fuse_norm``) both emit this, so their bits agree."""
    b = kb.b
    vw = pow2_divisor(m, kb.vw)
    nv = m // vw
    unroll = rmsnorm_unroll(m, kb.vw) if unroll is None else unroll
    if unroll < 1 or nv % unroll:
        raise NotImplementedError(f"rmsnorm: unroll {unroll} does not divide the {nv} vectors of a row")
    # sum of squares: `unroll` vector accumulators over blocks of unroll*vw, every operation
    # strict (fused multiply-adds, no reassociation): LLVM cannot compute it another way in another
    # kernel, so the matmuls that fuse the norm get the rmsnorm kernel's bits
    zero = fconst(0.0, vw)
    if nv == unroll:
        accs = []
        for k in range(unroll):
            v = kb.vload(xr, k * vw, vw)
            accs.append(b.fmul(v, v))
    else:
        with kb.loop_carry(0, m, [zero] * unroll, step=unroll * vw, name="ss") as (j, cur, setv):
            new = []
            for k in range(unroll):
                v = kb.vload(xr, b.add(j, i64(k * vw)), vw)
                new.append(kb.fma(v, v, cur[k]))
            setv(new)
        accs = kb.last_carry
    while len(accs) > 1:
        accs = [b.fadd(p, q) for p, q in zip(accs[0::2], accs[1::2])]
    acc = accs[0]
    while acc.type.count > 1:
        h = acc.type.count // 2
        lo = b.shuffle_vector(acc, acc, ir.Constant(ir.VectorType(ir.IntType(32), h), list(range(h))))
        hi = b.shuffle_vector(acc, acc, ir.Constant(ir.VectorType(ir.IntType(32), h), list(range(h, 2 * h))))
        acc = b.fadd(lo, hi)
    ss = b.extract_element(acc, i64(0))
    # ss = 1 / sqrt(mean + eps), in the reference's order, no fast-math
    mean = b.fdiv(ss, f32c(float(m)))
    inv = b.fdiv(f32c(1.0), kb.sqrt(b.fadd(mean, f32c(eps))))
    invv = kb.splat(inv, vw)

    def scale_block(j):
        v = kb.vload(xr, j, vw)
        kb.vstore(b.fmul(wload(j, vw), b.fmul(v, invv)), orow, j)

    if nv <= 8:
        for k in range(nv):
            scale_block(i64(k * vw))
    else:
        with kb.loop(0, m, step=vw, name="sc") as j:
            scale_block(j)


@kernel("rmsnorm")
def emit_rmsnorm(kb: KernelBuilder, sig: KernelSig) -> None:
    b = kb.b
    xt, wt = sig.in_types
    _check_f32(xt, "rmsnorm x")
    m = int(wt.shape[0])
    n = int(xt.shape[-1])
    eps = float(sig.attr["eps"])
    units = b.mul(kb.rows_of(xt.shape), i64(n // m))
    lo, hi = kb.thread_share(units)
    x = kb.in_f32(0)
    out = kb.out_f32()
    wload = weight_loader(kb, wt, kb.in_raw[1])
    unroll = int(sig.attr.get("unroll", rmsnorm_unroll(m, kb.vw)))  # an override from ``lmc kernel``
    kb.tuning["unroll"] = unroll
    with kb.loop(lo, hi, name="unit") as u:
        base = b.mul(u, i64(m))
        emit_rmsnorm_row(kb, kb.gep(x, base), kb.gep(out, base), wload, m, eps, unroll)


# --- layernorm ----------------------------------------------------------------------
@kernel("layernorm")
def emit_layernorm(kb: KernelBuilder, sig: KernelSig) -> None:
    """(x - mean) * inv * w + b per row, threads splitting rows: two passes
    over the row (mean, then the centred sum of squares), as the reference."""
    b = kb.b
    xt, wt, bt = sig.in_types
    _check_f32(xt, "layernorm x")
    m = int(xt.shape[-1])
    eps = float(sig.attr["eps"])
    lo, hi = kb.thread_share(kb.rows_of(xt.shape))
    x, out = kb.in_f32(0), kb.out_f32()
    wload = weight_loader(kb, wt, kb.in_raw[1])
    bload = weight_loader(kb, bt, kb.in_raw[2])
    vw = pow2_divisor(m, kb.vw)

    def row_sum(f) -> ir.Value:
        with kb.loop_carry(0, m, [fconst(0.0, vw)], step=vw, name="s") as (j, cur, setv):
            setv([kb.fadd(cur[0], f(j))])
        return b.extract_element(hsum_many(kb, kb.last_carry), i64(0))

    with kb.loop(lo, hi, name="row") as r:
        xr, orow = kb.gep(x, b.mul(r, i64(m))), kb.gep(out, b.mul(r, i64(m)))
        mean = kb.splat(b.fdiv(row_sum(lambda j: kb.vload(xr, j, vw)), f32c(float(m))), vw)

        def centred(j):
            return b.fsub(kb.vload(xr, j, vw), mean)

        var = b.fdiv(row_sum(lambda j: kb.fmul(centred(j), centred(j))), f32c(float(m)))
        inv = kb.splat(b.fdiv(f32c(1.0), kb.sqrt(b.fadd(var, f32c(eps)))), vw)
        with kb.loop(0, m, step=vw, name="y") as j:
            y = b.fadd(b.fmul(b.fmul(centred(j), inv), wload(j, vw)), bload(j, vw))
            kb.vstore(y, orow, j)


# --- rope -----------------------------------------------------------------------------
#: store(vector, j): a rotated head's values from element j on, to wherever they go
HeadStore = Callable[[ir.Value, int], None]
#: head(r, h) -> (store, done): where row r's head h goes; done() runs after its last store
HeadSink = Callable[[ir.Value, ir.Value], tuple[HeadStore, Callable[[], None]]]


@kernel("rope")
def emit_rope(kb: KernelBuilder, sig: KernelSig) -> None:
    """x (in0) rotated at pos (in1 or the pos argument) into out, row by row."""
    xt = sig.in_types[0]
    n, hd = int(xt.shape[-1]), int(sig.attr["head_dim"])
    out = kb.out_f32()

    def head(r: ir.Value, h: ir.Value) -> tuple[HeadStore, Callable[[], None]]:
        oh = kb.gep(out, kb.b.add(kb.b.mul(r, i64(n)), kb.b.mul(h, i64(hd))))
        return (lambda v, j: kb.vstore(v, oh, j)), (lambda: None)

    _rope_heads(kb, sig, 0, 1, 2 if len(sig.in_types) == 3 else None, head)


def _rope_heads(kb: KernelBuilder, sig: KernelSig, x_in: int, pos_in: int, ff_in: int | None,
                head: HeadSink) -> None:
    """Rotate pairs by position x frequency; the cos/sin table is built once
    per row (in scratch). Scaling (``ir.rope_tables``) changes only how the table's
    angles and magnitudes are computed: the same float32 steps in the same
    order as the reference, and none of them when the op is unscaled.
    Threads split (row, head) units; each rotated head goes to ``head(r, h)``
    (rope: its output row; rope_kv_write: its cache row)."""
    b = kb.b
    xt = sig.in_types[x_in]
    _check_f32(xt, "rope x")
    a = sig.attr
    hd = int(a["head_dim"])
    rot = int(a.get("dims") or hd)  # partial rotary: the first rot values of a head rotate, the rest are copied
    half = rot // 2
    style = a["style"]
    theta = float(a["theta"])
    n = int(xt.shape[-1])
    nh = n // hd
    # the frequencies exactly as rope_tables computes them (float32 numpy)
    ftab = const_f32_array(kb, "freq", rope_base_freqs(rot, theta).tolist())
    fs = float(np.float32(a.get("freq_scale", 1.0)))
    mix, mscale = rope_mix(rot, theta, a)
    if mix is not None:
        mixtab = const_f32_array(kb, "mix", mix.tolist())
        keeptab = const_f32_array(kb, "keep", (np.float32(1) - mix).astype(np.float32).tolist())
    ffp = None
    if ff_in is not None:
        _check_f32(sig.in_types[ff_in], "rope frequency factors")
        ffp = kb.fptr(kb.in_raw[ff_in])

    rows = kb.rows_of(xt.shape)
    units = b.mul(rows, i64(nh))
    lo, hi = kb.thread_share(units)
    x = kb.in_f32(x_in)
    # row r's position: pos + r, or positions[r] for a batch of sequences
    row_pos = RowPositions(kb, kb.in_raw[pos_in]) if sig.in_types[pos_in].rank == 1 else (lambda r: b.add(kb.pos, r))
    tab = kb.fptr(kb.scratch)  # cos at [0, half), sin at [half, rot)
    cos_f = kb.module.declare_intrinsic("llvm.cos", [F32])
    sin_f = kb.module.declare_intrinsic("llvm.sin", [F32])
    vw = pow2_divisor(half, kb.vw)
    nv = half // vw

    with kb.if_then(b.icmp_signed("<", lo, hi)):
        r0 = b.sdiv(lo, i64(nh))
        r1 = b.sdiv(b.add(hi, i64(nh - 1)), i64(nh))
        with kb.loop(r0, r1, name="row") as r:
            # this row's position and its cos/sin table (once per row, not per head)
            p = b.sitofp(row_pos(r), F32)
            with kb.loop(0, half, name="f") as i:
                ang = b.fmul(p, kb.load(ftab, i))  # float32 product, as the reference
                if ffp is not None:
                    ang = b.fdiv(ang, kb.load(ffp, i))
                if fs != 1.0 or mix is not None:
                    interp = b.fmul(f32c(fs), ang)
                    if mix is not None:
                        ang = b.fadd(b.fmul(interp, kb.load(keeptab, i)), b.fmul(ang, kb.load(mixtab, i)))
                    else:
                        ang = interp
                c, s = b.call(cos_f, [ang]), b.call(sin_f, [ang])
                if mscale != 1:
                    c, s = b.fmul(c, f32c(float(mscale))), b.fmul(s, f32c(float(mscale)))
                kb.store(c, tab, i)
                kb.store(s, tab, b.add(i, i64(half)))
            rbase = b.mul(r, i64(nh))
            h0 = kb.imax(b.sub(lo, rbase), i64(0))
            h1 = kb.imin(b.sub(hi, rbase), i64(nh))
            with kb.loop(h0, h1, name="head") as h:
                xh = kb.gep(x, b.add(b.mul(r, i64(n)), b.mul(h, i64(hd))))
                store, done = head(r, h)
                for k in range(nv):
                    c = kb.vload(tab, k * vw, vw)
                    s = kb.vload(tab, half + k * vw, vw)
                    if style == "interleaved":
                        pair = kb.vload(xh, 2 * k * vw, 2 * vw)
                        xa = b.shuffle_vector(pair, pair, _idx(range(0, 2 * vw, 2)))
                        xb = b.shuffle_vector(pair, pair, _idx(range(1, 2 * vw, 2)))
                    else:
                        xa = kb.vload(xh, k * vw, vw)
                        xb = kb.vload(xh, half + k * vw, vw)
                    # no fast-math: a*c - b*s and a*s + b*c exactly as numpy rounds them
                    ra = b.fsub(b.fmul(xa, c), b.fmul(xb, s))
                    rb = b.fadd(b.fmul(xa, s), b.fmul(xb, c))
                    if style == "interleaved":
                        inter = [j // 2 + (vw if j % 2 else 0) for j in range(2 * vw)]
                        store(b.shuffle_vector(ra, rb, _idx(inter)), 2 * k * vw)
                    else:
                        store(ra, k * vw)
                        store(rb, half + k * vw)
                if rot < hd:
                    tw = pow2_divisor(hd - rot, kb.vw)
                    for j in range(rot, hd, tw):
                        store(kb.vload(xh, j, tw), j)
                done()


# --- rope_kv_write ----------------------------------------------------------------------
@kernel("rope_kv_write", "rope_kv_write_paged")
def emit_rope_kv_write(kb: KernelBuilder, sig: KernelSig) -> None:
    """kv_write(cache, rope(x, pos), pos) in one pass: each rotated head is
    stored straight into its cache row (``out`` and ``in0`` are the cache,
    x is in1, pos in2 (paged: positions in2, block tables in3), frequency
    factors last). The rotation is ``_rope_heads``'s, the store rounds as
    kv_write's: f32 as is, f16 by fptrunc, q8 a head at a time (whole
    blocks: the op's type rule) quantized by ``_q8_block`` from the rotated
    head kept in scratch after the cos/sin table."""
    b = kb.b
    ct = sig.in_types[0]
    paged = sig.op == "rope_kv_write_paged"
    ff_in = (4 if paged else 3) if len(sig.in_types) == (5 if paged else 4) else None
    d, hd = int(ct.shape[1]), int(sig.attr["head_dim"])
    if paged:
        rows = PagedRows(kb, kb.in_raw[2], kb.in_raw[3], int(sig.attr["block_size"]), int(sig.in_types[3].shape[1]))
        cache_row = rows.own_row
    else:
        def cache_row(r: ir.Value) -> ir.Value:
            return _ring_row(kb, sig, b.add(kb.pos, r))

    low = lowbit(ct.layout)
    off = _offset(kb, sig, low is not None)
    if low is not None:
        _check_q8_row(d)
        buf = kb.gep(kb.fptr(kb.scratch), _rope_table_floats(sig))
        wd = pow2_divisor(hd, kb.vw)

        def head(r: ir.Value, h: ir.Value) -> tuple[HeadStore, Callable[[], None]]:
            first = b.add(b.mul(cache_row(r), i64(d // GROUP)), b.mul(h, i64(hd // GROUP)))
            hoff = None if off is None else kb.gep(off, b.mul(h, i64(hd)))   # the head's offsets

            def store(v: ir.Value, j: int) -> None:
                kb.vstore(v if hoff is None else b.fsub(v, kb.vload(hoff, j, v.type.count)), buf, j)

            def done() -> None:
                vs = [kb.vload(buf, k * wd, wd) for k in range(hd // wd)]
                _store_head(kb, low, lb_emit.fwht(kb, vs) if low.rotate else vs, first)

            return store, done
    elif ct.layout == "Q8_0":
        _check_q8_row(d)
        buf = kb.gep(kb.fptr(kb.scratch), _rope_table_floats(sig))

        def head(r: ir.Value, h: ir.Value) -> tuple[HeadStore, Callable[[], None]]:
            first = b.add(b.mul(cache_row(r), i64(d // QK)), b.mul(h, i64(hd // QK)))  # the head's first block

            def done() -> None:
                for k in range(hd // QK):
                    _q8_block(kb, buf, k * QK, kb.gep(kb.out_raw, b.mul(b.add(first, i64(k)), i64(Q8_BYTES))))

            return (lambda v, j: kb.vstore(v, buf, j)), done
    else:
        if ct.dtype != "f16":
            _check_f32(ct, "rope_kv_write cache")
        half = ct.dtype == "f16"
        dst = b.bitcast(kb.out_raw, ir.PointerType(HALF if half else F32))

        def head(r: ir.Value, h: ir.Value) -> tuple[HeadStore, Callable[[], None]]:
            at = kb.gep(dst, b.add(b.mul(cache_row(r), i64(d)), b.mul(h, i64(hd))))

            def store(v: ir.Value, j: int) -> None:
                w = v.type.count
                kb.vstore(b.fptrunc(v, ir.VectorType(HALF, w)) if half else v, at, j)

            return store, (lambda: None)

    _rope_heads(kb, sig, 1, 2, ff_in, head)


def _rope_table_floats(sig: KernelSig) -> int:
    """Scratch floats of the cos/sin table: ``dims`` (or head_dim)."""
    return int(sig.attr.get("dims") or sig.attr["head_dim"])


def _idx(values) -> ir.Constant:
    values = list(values)
    return ir.Constant(ir.VectorType(ir.IntType(32), len(values)), values)


# --- take_last ------------------------------------------------------------------------
@kernel("take_last")
def emit_take_last(kb: KernelBuilder, sig: KernelSig) -> None:
    b = kb.b
    (xt,) = sig.in_types
    _check_f32(xt, "take_last x")
    n = int(xt.shape[1])
    last = b.sub(kb.dim(xt.shape[0]), i64(1))
    lo, hi = kb.thread_share(n)  # columns
    src = kb.gep(kb.in_f32(0), b.add(b.mul(last, i64(n)), lo))
    dst = kb.gep(kb.out_f32(), lo)
    with kb.if_then(b.icmp_signed("<", lo, hi)):
        memcpy(kb, b.bitcast(dst, kb.out_raw.type), b.bitcast(src, kb.out_raw.type),
               b.mul(b.sub(hi, lo), i64(4)))


# --- take_rows ------------------------------------------------------------------------
@kernel("take_rows")
def emit_take_rows(kb: KernelBuilder, sig: KernelSig) -> None:
    """Rows of x by index (input 1, i32), each thread a share of the columns."""
    b = kb.b
    xt, rt = sig.in_types
    _check_f32(xt, "take_rows x")
    n, r = int(xt.shape[1]), int(rt.shape[0])
    lo, hi = kb.thread_share(n)
    idx = b.bitcast(kb.in_raw[1], ir.PointerType(ir.IntType(32)))
    with kb.if_then(b.icmp_signed("<", lo, hi)):
        with kb.loop(0, r, name="row") as i:
            src_row = b.sext(b.load(kb.gep(idx, i)), ir.IntType(64))
            src = kb.gep(kb.in_f32(0), b.add(b.mul(src_row, i64(n)), lo))
            dst = kb.gep(kb.out_f32(), b.add(b.mul(i, i64(n)), lo))
            memcpy(kb, b.bitcast(dst, kb.out_raw.type), b.bitcast(src, kb.out_raw.type),
                   b.mul(b.sub(hi, lo), i64(4)))


# --- kv_write -------------------------------------------------------------------------
#: where x's unit u (of ``per`` units to a row) goes, in the same units of the cache
UnitIndex = Callable[[ir.Value], ir.Value]


def _ring_row(kb: KernelBuilder, sig: KernelSig, p: ir.Value) -> ir.Value:
    """The cache row of position p: p itself, or p % R in a ring of R rows
    (a sliding-window layer's cache, ``ir.ops.attention``)."""
    ring = int(sig.attr.get("ring") or 0)
    return kb.b.urem(p, i64(ring)) if ring else p


def _contiguous(kb: KernelBuilder, sig: KernelSig, per: int) -> UnitIndex:
    """kv_write: x's rows go to cache rows pos, pos + 1, ... (a ring's
    rows wrap)."""
    b = kb.b
    if sig.attr.get("ring"):
        return lambda u: b.add(b.mul(_ring_row(kb, sig, b.add(kb.pos, b.udiv(u, i64(per)))), i64(per)),
                               b.urem(u, i64(per)))
    return lambda u: b.add(b.mul(kb.pos, i64(per)), u)


def _paged(kb: KernelBuilder, sig: KernelSig, per: int) -> UnitIndex:
    """kv_write_paged: x's row r goes to the pool row of positions[r]."""
    rows = PagedRows(kb, kb.in_raw[2], kb.in_raw[3], int(sig.attr["block_size"]), int(sig.in_types[3].shape[1]))
    b = kb.b
    return lambda u: b.add(b.mul(rows.own_row(b.udiv(u, i64(per))), i64(per)), b.urem(u, i64(per)))


@kernel("kv_write", "kv_write_paged")
def emit_kv_write(kb: KernelBuilder, sig: KernelSig) -> None:
    """cache[pos + r] = x[r] (kv_write_paged: pool row of (r, positions[r])).
    ``out`` and ``in0`` are both the cache; x is in1, pos comes in the
    kernel's pos argument (paged: positions and block tables in in2, in3).
    NO bounds check: the runtime guarantees 0 <= pos and pos + rows <=
    cache length (paged: ``runtime.paged.check_batch``), as the references
    would raise. f16 and q8 caches convert on store (``_kv_write_vectors``,
    ``_kv_write_q8``); an f32 cache is a copy (one memcpy per thread when
    the rows are contiguous)."""
    ct, xt = sig.in_types[0], sig.in_types[1]
    _check_f32(xt, "kv_write x")
    d = int(ct.shape[1])

    def index(per: int) -> UnitIndex:
        return _paged(kb, sig, per) if sig.op == "kv_write_paged" else _contiguous(kb, sig, per)

    low = lowbit(ct.layout)
    off = _offset(kb, sig, low is not None or ct.layout is None)
    if low is not None:
        _check_q8_row(d)
        _kv_write_lowbit(kb, low, d, xt, index(d // (low.rotate or GROUP)), off)
        return
    if ct.layout == "Q8_0":
        _check_q8_row(d)
        _kv_write_q8(kb, d, xt, index(d // QK))
        return
    sink = int(sig.attr.get("sink") or 0)
    if ct.dtype != "f16":
        _check_f32(ct, "kv_write cache")
        if sig.op == "kv_write" and not sig.attr.get("ring") and off is None and not sink:
            _kv_copy(kb, d, xt)
            return
    w = pow2_divisor(d, kb.vw)
    elem = HALF if ct.dtype == "f16" else F32
    _kv_write_vectors(kb, d, xt, index(d // w), elem, off)
    if sink:   # position 0 also in the cache's last row (``ir.ops.attention``)
        last = int(ct.shape[0]) - 1
        with kb.if_then(kb.b.icmp_signed("==", kb.pos, i64(0))):
            _kv_write_vectors(kb, d, xt, lambda u: kb.b.add(i64(last * (d // w)), u), elem, off, rows=i64(1))


def _kv_copy(kb: KernelBuilder, d: int, xt) -> None:
    """An f32 cache, rows from pos on: x's elements as one flat run."""
    b = kb.b
    numel = b.mul(kb.rows_of(xt.shape), i64(int(xt.shape[-1])))
    lo, hi = kb.thread_share(numel)
    dst = kb.gep(kb.out_f32(), b.add(b.mul(kb.pos, i64(d)), lo))
    src = kb.gep(kb.fptr(kb.in_raw[1]), lo)
    with kb.if_then(b.icmp_signed("<", lo, hi)):
        memcpy(kb, b.bitcast(dst, kb.out_raw.type), b.bitcast(src, kb.out_raw.type),
               b.mul(b.sub(hi, lo), i64(4)))


HALF = ir.HalfType()
QK, Q8_BYTES = 32, 34


def _check_q8_row(d: int) -> None:
    if d % QK:
        raise NotImplementedError(f"kv_write: a q8 cache row of {d} values is not whole blocks of {QK}")


def _kv_write_vectors(kb: KernelBuilder, d: int, xt, at: UnitIndex, elem: ir.Type, off: ir.Value | None = None,
                      rows: ir.Value | None = None) -> None:
    """An f16 cache: f32 -> f16 (fptrunc: round to nearest even, overflow to
    inf); an f32 pool: a copy. Split between threads in vectors of the
    widest power of two dividing a row; vector u goes to vector ``at(u)``,
    minus the row's ``off`` first. ``rows``: x's first rows only."""
    b = kb.b
    w = pow2_divisor(d, kb.vw)
    lo, hi = kb.thread_share(b.mul(kb.rows_of(xt.shape) if rows is None else rows, i64(d // w)))
    src = kb.fptr(kb.in_raw[1])
    dst = b.bitcast(kb.out_raw, ir.PointerType(elem))
    with kb.loop(lo, hi, name="cv") as u:
        v = kb.vload(src, b.mul(u, i64(w)), w)
        if off is not None:   # vector u is vector u % (d / w) of its row
            v = b.fsub(v, kb.vload(off, b.mul(b.urem(u, i64(d // w)), i64(w)), w))
        kb.vstore(v if elem is F32 else b.fptrunc(v, ir.VectorType(HALF, w)), dst, b.mul(at(u), i64(w)))


def _kv_write_q8(kb: KernelBuilder, d: int, xt, at: UnitIndex) -> None:
    """Q8_0 blocks, split between threads by block; block j goes to cache
    block ``at(j)`` (``_q8_block``)."""
    b = kb.b
    lo, hi = kb.thread_share(b.mul(kb.rows_of(xt.shape), i64(d // QK)))
    src = kb.fptr(kb.in_raw[1])
    with kb.loop(lo, hi, name="qb") as j:
        _q8_block(kb, src, b.mul(j, i64(QK)), kb.gep(kb.out_raw, b.mul(at(j), i64(Q8_BYTES))))


def _offset(kb: KernelBuilder, sig: KernelSig, allowed: bool) -> ir.Value | None:
    """A float* to the write's ``offset`` row (a constant table: the key
    offset of a low-bit cache, ``ir.ops.attention``), None without one."""
    off = sig.attr.get("offset")
    if off is None:
        return None
    if not allowed:   # (the kernel has no such store: a q8 cache's, or rope_kv_write's f16 one)
        raise NotImplementedError(f"{sig.op}: no offset is subtracted before a {sig.in_types[0]} cache here")
    return const_f32_array(kb, "offset", off)


def _kv_write_lowbit(kb: KernelBuilder, f: LowBit, d: int, xt, at: UnitIndex,
                     off: ir.Value | None = None) -> None:
    """Low-bit groups (``ir.kv_lowbit``). Plain: units are groups of 32;
    rotated: units are heads, each rotated in registers (``kv_lowbit.fwht``)
    then quantized group by group. Unit j goes to cache unit ``at(j)``; a
    row's offset (``off``) is subtracted first."""
    b = kb.b
    unit = f.rotate or GROUP
    lo, hi = kb.thread_share(b.mul(kb.rows_of(xt.shape), i64(d // unit)))
    src = kb.fptr(kb.in_raw[1])
    wd = pow2_divisor(unit, kb.vw)
    with kb.loop(lo, hi, name="lb") as j:
        vs = [kb.vload(src, b.add(b.mul(j, i64(unit)), i64(k * wd)), wd) for k in range(unit // wd)]
        if off is not None:   # unit j is unit j % (d / unit) of its row
            uoff = kb.gep(off, b.mul(b.urem(j, i64(d // unit)), i64(unit)))
            vs = [b.fsub(v, kb.vload(uoff, k * wd, wd)) for k, v in enumerate(vs)]
        _store_head(kb, f, lb_emit.fwht(kb, vs) if f.rotate else vs, b.mul(at(j), i64(unit // GROUP)))


def _store_head(kb: KernelBuilder, f: LowBit, vs: list[ir.Value], first: ir.Value) -> None:
    """Vectors of whole groups (in value order) quantized into the cache's
    groups first, first + 1, ..."""
    b = kb.b
    wd = vs[0].type.count
    per = GROUP // wd
    for g in range(len(vs) // per):
        x = concat(b, vs[g * per:(g + 1) * per]) if per > 1 else vs[g * per]
        lb_emit.store_group(kb, f, x, kb.gep(kb.out_raw, b.mul(b.add(first, i64(g)), i64(f.group_bytes))))


def _q8_block(kb: KernelBuilder, src: ir.Value, at: ir.Value | int, bp: ir.Value) -> None:
    """The 32 floats at src[at] as one Q8_0 block at byte pointer bp,
    quantized exactly as ``ir.int_dot.quantize_q8_rows`` (by the integer dot's
    own ``act_quant.quantize_q8_block``: d = f16(amax / 127), q = rint(x * (127 / amax)))."""
    b = kb.b
    q, d, _ = quantize_q8_block(kb, i64(at) if isinstance(at, int) else at, src)
    b.store(b.fptrunc(d, HALF), b.bitcast(bp, ir.PointerType(HALF)), align=2)   # d is a float16 value: exact
    kb.vstore(q, bp, 2)
