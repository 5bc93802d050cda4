"""The low-bit KV cache in registers (``ir.kv_lowbit``: groups of 32 codes of
4 or 2 bits, an f16 step d and minimum m, rows rotated per head by a
normalized Walsh-Hadamard transform for q4 / q2): the rotation, a group's
quantization and its decoding, shared by the writes (``k_norm_rope``) and
attention (``k_attention``).

The rotation is the fast transform over a head held as a list of vectors:
log2(head_dim) butterfly stages (a + b, a - b) at distance 1, 2, 4, ...;
distances inside a vector are one shuffle, an add, a subtract and a
select; distances of whole vectors pair the vectors. Then one multiply by
1/sqrt(n). Every output of a stage is a single add or subtract of two
float32s, so the bits are those of ``ir.kv_lowbit.fwht`` in numpy.
"""
from __future__ import annotations

import math

from llvmlite import ir

from ir.kv_lowbit import GROUP, LowBit

from .emit import F32, KernelBuilder, fconst
from .simd import HALF, I8, concat, shuffle, vconst


def fwht(kb: KernelBuilder, vs: list[ir.Value]) -> list[ir.Value]:
    """A head (``vs``: equal-width vectors, n = width x len values, a power of
    two) times H / sqrt(n) (module docstring)."""
    b = kb.b
    w = vs[0].type.count
    n = w * len(vs)
    vs = list(vs)
    h = 1
    while h < w:  # partner inside the vector: lane i ^ h
        upper = vconst(ir.IntType(1), [bool(i & h) for i in range(w)])
        out = []
        for v in vs:
            sw = shuffle(b, v, None, [i ^ h for i in range(w)])
            out.append(b.select(upper, b.fsub(sw, v), b.fadd(v, sw)))   # lower: a + b; upper: a - b
        vs = out
        h *= 2
    while h < n:  # partner hv vectors away
        hv = h // w
        out = list(vs)
        for i in range(len(vs)):
            if i & hv == 0:
                a, c = vs[i], vs[i + hv]
                out[i], out[i + hv] = b.fadd(a, c), b.fsub(a, c)
        vs = out
        h *= 2
    s = fconst(float(1.0 / math.sqrt(n)), w)   # float32(1/sqrt(n)), as numpy rounds it
    return [b.fmul(v, s) for v in vs]


def store_group(kb: KernelBuilder, f: LowBit, x: ir.Value, bp: ir.Value) -> None:
    """<32 x float> x as one group at byte pointer bp, quantized exactly as
    ``ir.kv_lowbit.encode``: d = f16((max - min) / L), m = f16(min),
    code = clamp(rint((x - m) * (1/d or 0)), 0, L)."""
    b = kb.b
    mn = kb._reduce(x, lambda p, q: kb.intrinsic("llvm.minnum", [p, q]))
    mx = kb._reduce(x, lambda p, q: kb.intrinsic("llvm.maxnum", [p, q]))
    d16 = b.fptrunc(b.fdiv(b.fsub(mx, mn), ir.Constant(F32, float(f.levels))), HALF)
    m16 = b.fptrunc(mn, HALF)
    d, m = b.fpext(d16, F32), b.fpext(m16, F32)
    pos = b.fcmp_ordered(">", d, ir.Constant(F32, 0.0))
    inv = b.select(pos, b.fdiv(ir.Constant(F32, 1.0), b.select(pos, d, ir.Constant(F32, 1.0))),
                   ir.Constant(F32, 0.0))
    r = kb.intrinsic("llvm.roundeven", [b.fmul(b.fsub(x, kb.splat(m, GROUP)), kb.splat(inv, GROUP))])
    # NaN -> 0 (as numpy's nan_to_num), then clamp to [0, L]
    r = b.select(b.fcmp_ordered("==", r, r), r, fconst(0.0, GROUP))
    r = kb.intrinsic("llvm.maxnum", [r, fconst(0.0, GROUP)])
    r = kb.intrinsic("llvm.minnum", [r, fconst(float(f.levels), GROUP)])
    codes = b.fptoui(r, ir.VectorType(I8, GROUP))
    hp = b.bitcast(bp, ir.PointerType(HALF))
    b.store(d16, hp, align=1)
    b.store(m16, kb.gep(hp, 1), align=1)
    per = 8 // f.bits
    step = GROUP // per
    packed = None
    for k in range(per):
        part = shuffle(b, codes, None, range(k * step, (k + 1) * step))
        if k:
            part = b.shl(part, vconst(I8, [k * f.bits] * step))
        packed = part if packed is None else b.or_(packed, part)
    kb.vstore(packed, kb.gep(bp, 4), 0)


def group_scales(kb: KernelBuilder, bp: ir.Value) -> tuple[ir.Value, ir.Value]:
    """d and m (float32) of the group at byte pointer bp."""
    b = kb.b
    hp = b.bitcast(bp, ir.PointerType(HALF))
    return b.fpext(b.load(hp, align=1), F32), b.fpext(b.load(kb.gep(hp, 1), align=1), F32)


def group_codes(kb: KernelBuilder, f: LowBit, bp: ir.Value, wd: int) -> list[ir.Value]:
    """The 32 codes of the group at byte pointer bp as float vectors of wd
    (in value order)."""
    b = kb.b
    per = 8 // f.bits
    step = GROUP // per
    raw = kb.vload(kb.gep(bp, 4), 0, step)   # <step x i8>
    mask = vconst(I8, [(1 << f.bits) - 1] * step)
    parts = [b.and_(b.lshr(raw, vconst(I8, [k * f.bits] * step)) if k else raw, mask) for k in range(per)]
    allc = b.uitofp(concat(b, parts), ir.VectorType(F32, GROUP))
    return [shuffle(b, allc, None, range(k * wd, (k + 1) * wd)) for k in range(GROUP // wd)]
