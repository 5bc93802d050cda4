"""Causal grouped-query attention against the KV cache (``attention_ref``).

Work units are (row t, query head h) pairs, t-major, split between threads.
Row t sits at position pos+t and sees cache positions [start, pos+t] with
start = max(0, pos+t+1-window) when a window is set, else 0; query head h
reads kv head h // (n_heads / n_kv_heads).

Per unit, two passes over the visible positions:

1. scores s_j = (k_j . q) * scale into this thread's scratch, B positions at
   a time: B dot products with q held in registers, their horizontal sums
   folded into one <B x float> (``hsum_many``), stored and max-reduced as a
   vector. Leftover positions (n % B) go one by one.
2. p_j = exp(s_j - max) (inline vector exp, ``exp_poly``), sum += p_j and
   acc += p_j * v_j with acc a few vector registers spanning head_dim; then
   out = acc / sum.

Vectors over head_dim have the largest power-of-two width <= the target's
that divides head_dim, so any head_dim works without a scalar tail (8 ->
<8 x float>, 24 -> 3 x <8 x float>, 6 -> 3 x <2 x float>).
"""
from __future__ import annotations

import llvmlite.ir as ir

from .emit import KernelBuilder, exp_poly, fconst, fmuladd, hsum_many, i64, pow2_divisor
from .kernels import KernelSig, kernel

#: positions per block in the score / weighted-sum passes
BLOCK = 8


def scratch_floats(sig: KernelSig) -> int:
    """Per-thread scratch (float32 elements): attention keeps one score per
    visible position, at most the cache length; the other ops here need none."""
    if sig.op == "attention":
        return int(sig.in_types[1].shape[0])
    return 0


@kernel("attention")
def emit_attention(kb: KernelBuilder, sig: KernelSig) -> None:
    b = kb.b
    a = sig.attr
    H, KVH, hd = int(a["n_heads"]), int(a["n_kv_heads"]), int(a["head_dim"])
    scale = float(a["scale"])
    window = int(a.get("window", 0) or 0)
    group = H // KVH
    qt, kt, vt = sig.in_types[:3]
    for t in (qt, kt, vt):
        if t.dtype != "f32" or (t.layout or "F32") != "F32":
            raise NotImplementedError(f"attention: native kernel needs f32 operands, got {t}")
    stride = KVH * hd  # floats per cache row

    wd = pow2_divisor(hd, kb.vw)  # vector width over head_dim
    nvec = hd // wd
    B = BLOCK

    units = b.mul(kb.rows_of(qt.shape), i64(H))
    lo, hi = kb.thread_share(units)
    q = kb.in_f32(0)
    kc = kb.in_f32(1)
    vc = kb.in_f32(2)
    out = kb.out_f32()
    sc = kb.fptr(kb.scratch)
    scale_s = fconst(scale)
    scale_v = fconst(scale, B)

    with kb.loop(lo, hi, name="unit") as u:
        t = b.udiv(u, i64(H))
        h = b.urem(u, i64(H))
        kvh = b.udiv(h, i64(group))
        end = b.add(b.add(kb.pos, t), i64(1))
        start = kb.imax(b.sub(end, i64(window)), i64(0)) if window else i64(0)
        n = b.sub(end, start)
        nb = b.and_(n, i64(-B))  # positions covered by whole blocks
        first = b.add(b.mul(start, i64(stride)), b.mul(kvh, i64(hd)))
        kbase = kb.gep(kc, first)  # position start+j at kbase + j*stride
        vbase = kb.gep(vc, first)
        qp = kb.gep(q, b.mul(u, i64(hd)))
        op = kb.gep(out, b.mul(u, i64(hd)))
        qv = [kb.vload(qp, c * wd, wd) for c in range(nvec)]

        def dot(j: ir.Value) -> ir.Value:
            """<wd x float> partial products of k_j . q (lanes still to sum)."""
            kp = kb.gep(kbase, b.mul(j, i64(stride)))
            acc = kb.fmul(kb.vload(kp, 0, wd), qv[0])
            for c in range(1, nvec):
                acc = fmuladd(kb, kb.vload(kp, c * wd, wd), qv[c], acc)
            return acc

        # pass 1: scores and their max
        ninf = fconst(float("-inf"), B)
        with kb.loop_carry(0, nb, [ninf], step=B, name="sb") as (j, (mv,), setv):
            s = hsum_many(kb, [dot(b.add(j, i64(p))) for p in range(B)])
            s = kb.fmul(s, scale_v)
            kb.vstore(s, sc, j)
            setv([kb.fmax(mv, s)])
        m0 = kb.hmax(kb.last_carry[0])
        with kb.loop_carry(nb, n, [m0], name="st") as (j, (m,), setv):
            s = kb.fmul(b.extract_element(hsum_many(kb, [dot(j)]), i64(0)), scale_s)
            kb.store(s, sc, j)
            setv([kb.fmax(m, s)])
        mx = kb.last_carry[0]
        mx_v = kb.splat(mx, B)

        # pass 2: p = exp(s - max); acc += p * v; sum += p
        zero_acc = [fconst(0.0, wd)] * nvec

        def accumulate(accs: list[ir.Value], pj: ir.Value, j: ir.Value) -> list[ir.Value]:
            vp = kb.gep(vbase, b.mul(j, i64(stride)))
            ps = kb.splat(pj, wd)
            return [fmuladd(kb, ps, kb.vload(vp, c * wd, wd), accs[c]) for c in range(nvec)]

        with kb.loop_carry(0, nb, [fconst(0.0, B)] + zero_acc, step=B, name="vb") as (j, cur, setv):
            pv = exp_poly(kb, kb.fsub(kb.vload(sc, j, B), mx_v))
            accs = cur[1:]
            for p in range(B):
                accs = accumulate(accs, b.extract_element(pv, i64(p)), b.add(j, i64(p)))
            setv([kb.fadd(cur[0], pv)] + accs)
        sum0 = kb.hsum(kb.last_carry[0])
        with kb.loop_carry(nb, n, [sum0] + kb.last_carry[1:], name="vt") as (j, cur, setv):
            pj = exp_poly(kb, kb.fsub(kb.load(sc, j), mx))
            setv([kb.fadd(cur[0], pj)] + accumulate(cur[1:], pj, j))
        total = kb.last_carry[0]
        accs = kb.last_carry[1:]
        inv = kb.splat(b.fdiv(fconst(1.0), total), wd)
        for c in range(nvec):
            kb.vstore(b.fmul(accs[c], inv), op, c * wd)

