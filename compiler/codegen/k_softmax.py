"""Row-wise softmax (``softmax_ref``): out = exp(x - max) / sum(exp(x - max))
over the last axis.

Threads split the rows (a single row runs on one thread: splitting it would
need a barrier between the max, the sum and the scaling). Per row of n
values, three passes, each over ``U`` whole vectors per iteration (``U``
independent accumulators, so the max and add chains pipeline), then the
leftover whole vectors and the last ``n % width`` values one by one, all at
constant offsets:

1. the row's max;
2. e = exp(x - max) (inline vector exp, ``exp_poly``) into ``out``, summed;
3. out *= 1 / sum.

The row is read once from memory; passes 2 and 3 find it in cache for rows
up to a vocabulary's length. ``U`` is ``UNROLL`` unless the kernel attribute
``unroll`` sets it (``lmc kernel softmax --unroll U``).
"""
from __future__ import annotations

import llvmlite.ir as ir

from .emit import KernelBuilder, exp_poly, fconst, i64
from .kernels import KernelSig, kernel

#: vectors per loop iteration (independent accumulators)
UNROLL = 4


def _fold(kb: KernelBuilder, vs: list[ir.Value], combine) -> ir.Value:
    while len(vs) > 1:
        vs = [combine(a, b) for a, b in zip(vs[0::2], vs[1::2])] + ([vs[-1]] if len(vs) % 2 else [])
    return vs[0]


@kernel("softmax")
def emit_softmax(kb: KernelBuilder, sig: KernelSig) -> None:
    b = kb.b
    (xt,) = sig.in_types
    if xt.dtype != "f32" or (xt.layout or "F32") != "F32":
        raise NotImplementedError(f"softmax: native kernel needs f32 data, got {xt}")
    n = int(xt.shape[-1])
    vw = kb.vw
    U = int(sig.attr.get("unroll", UNROLL))
    if U < 1:
        raise NotImplementedError(f"softmax: unroll must be >= 1, got {U}")
    kb.tuning["unroll"] = U
    S = vw * U
    nmain = n - n % S
    tail_vecs = [nmain + i * vw for i in range((n - nmain) // vw)]   # whole vectors after the loop
    tail_vals = list(range(nmain + len(tail_vecs) * vw, n))          # single values at the end

    lo, hi = kb.thread_share(kb.rows_of(xt.shape))
    x, out = kb.in_f32(0), kb.out_f32()
    with kb.loop(lo, hi, name="row") as r:
        xr = kb.gep(x, b.mul(r, i64(n)))
        orow = kb.gep(out, b.mul(r, i64(n)))

        def over_row(inits: list[ir.Value], vec_body, name: str) -> list[ir.Value]:
            """vec_body(col, u, acc) -> acc over the whole vectors of the row."""
            accs = list(inits)
            if nmain:
                with kb.loop_carry(0, nmain, accs, step=S, name=name) as (j, cur, setv):
                    setv([vec_body(b.add(j, i64(u * vw)), cur[u]) for u in range(U)])
                accs = list(kb.last_carry)
            for i, c in enumerate(tail_vecs):
                accs[i % U] = vec_body(i64(c), accs[i % U])
            return accs

        # pass 1: the max
        accs = over_row([fconst(float("-inf"), vw)] * U, lambda c, a: kb.fmax(a, kb.vload(xr, c)), "mx")
        m = kb.hmax(_fold(kb, accs, kb.fmax))
        for c in tail_vals:
            m = kb.fmax(m, kb.load(xr, c))
        mv = kb.splat(m)

        # pass 2: e = exp(x - max) into out, and its sum
        def exp_store(c: ir.Value, acc: ir.Value) -> ir.Value:
            e = exp_poly(kb, kb.fsub(kb.vload(xr, c), mv))
            kb.vstore(e, orow, c)
            return kb.fadd(acc, e)

        accs = over_row([fconst(0.0, vw)] * U, exp_store, "ex")
        total = kb.hsum(_fold(kb, accs, kb.fadd))
        for c in tail_vals:
            e = exp_poly(kb, kb.fsub(kb.load(xr, c), m))
            kb.store(e, orow, c)
            total = kb.fadd(total, e)

        # pass 3: scale by 1 / sum
        inv = b.fdiv(fconst(1.0), total)
        invv = kb.splat(inv)

        def scale(c: ir.Value, acc: ir.Value) -> ir.Value:
            kb.vstore(kb.fmul(kb.vload(orow, c), invv), orow, c)
            return acc

        over_row([fconst(0.0, vw)] * U, scale, "sc")
        for c in tail_vals:
            kb.store(kb.fmul(kb.load(orow, c), inv), orow, c)
