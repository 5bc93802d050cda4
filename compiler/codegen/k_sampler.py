"""The sampler's kernels: run.c's softmax (and its draw, ``sample_mult``)
in native code, calling the C library's own ``expf``; and the constants of
glibc's expf, which the runtime's numpy emulation (``runtime.sampling.
expf_glibc``) computes with too.

The numpy emulation is exact but costs milliseconds per token at a
32000-token vocabulary; this calls the real ``expf`` in a compiled loop (no
fast-math: the same operations in the same order as run.c: max, expf(x -
max), sequential float sum, divide), so it is exact and fast. Where glibc
runs its x86-64 FMA build, ``vector_expf`` computes that expf 8 lanes at a
time instead of a call per value (the same bits). Compiled once per
process, on first use, and kept in the compile cache (a warm start does not
load LLVM); the runtime only calls ``sampler_kernels()``.
"""
from __future__ import annotations

import ctypes
import functools
from decimal import Decimal, localcontext

import numpy as np


# --- glibc's expf: its table and constants (x86-64 FMA build) ------------------------------------
def _exp2_table() -> np.ndarray:
    # 2^(i/32) rounded to double, with i << 47 subtracted from the bits so that
    # adding the whole reduction integer k << 47 later installs 2^(k/32)'s
    # exponent. Equal to glibc's __exp2f_data.tab (checked).
    with localcontext() as ctx:
        ctx.prec = 60
        vals = [float(Decimal(2) ** (Decimal(i) / Decimal(32))) for i in range(32)]
    bits = np.array(vals, dtype=np.float64).view(np.uint64)
    return bits - (np.arange(32, dtype=np.uint64) << np.uint64(47))


#: glibc's ``__exp2f_data.tab`` (as uint64 bits, pre-shifted): ``_exp2_table()``, written out
#: because its 60-digit powers cost every start 5 ms (a test checks the two agree)
EXP2F_TABLE = np.array([
    0x3ff0000000000000, 0x3fefd9b0d3158574, 0x3fefb5586cf9890f, 0x3fef9301d0125b51,
    0x3fef72b83c7d517b, 0x3fef54873168b9aa, 0x3fef387a6e756238, 0x3fef1e9df51fdee1,
    0x3fef06fe0a31b715, 0x3feef1a7373aa9cb, 0x3feedea64c123422, 0x3feece086061892d,
    0x3feebfdad5362a27, 0x3feeb42b569d4f82, 0x3feeab07dd485429, 0x3feea47eb03a5585,
    0x3feea09e667f3bcd, 0x3fee9f75e8ec5f74, 0x3feea11473eb0187, 0x3feea589994cce13,
    0x3feeace5422aa0db, 0x3feeb737b0cdc5e5, 0x3feec49182a3f090, 0x3feed503b23e255d,
    0x3feee89f995ad3ad, 0x3feeff76f2fb5e47, 0x3fef199bdd85529c, 0x3fef3720dcef9069,
    0x3fef5818dcfba487, 0x3fef7c97337b9b5f, 0x3fefa4afa2a490da, 0x3fefd0765b6e4540,
], dtype=np.uint64)
# glibc's polynomial for 2^(r/32) on |r| <= 1/2 and its scaled 32/ln2.
# Dividing by 32 is exact, as in glibc's own definitions.
EXPF_C0 = float.fromhex("0x1.c6af84b912394p-5") / 32 / 32 / 32
EXPF_C1 = float.fromhex("0x1.ebfce50fac4f3p-3") / 32 / 32
EXPF_C2 = float.fromhex("0x1.62e42ff0c52d6p-1") / 32
EXPF_INVLN2N = float.fromhex("0x1.71547652b82fep+0") * 32
EXPF_SHIFT = float.fromhex("0x1.8p+52")
#: above: +inf
EXPF_OVERFLOW = np.float32(float.fromhex("0x1.62e42ep6"))
#: below: 2^-149
EXPF_MAY_UNDERFLOW = np.float32(float.fromhex("-0x1.9d1d9ep6"))
#: below: 0
EXPF_UNDERFLOW = np.float32(float.fromhex("-0x1.9fe368p6"))

_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
_DRAW = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float)
_EXPS = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float)
_MASK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


def build_module(vector_exp: bool):
    """The softmax loop and the fused softmax-and-draw as an LLVM module;
    ``vector_exp``: glibc's expf computed 8 lanes at a time (``vector_expf``)."""
    import llvmlite.ir as ir

    f32, i64 = ir.FloatType(), ir.IntType(64)
    fp = ir.PointerType(f32)
    m = ir.Module("softmax")
    expf = ir.Function(m, ir.FunctionType(f32, [f32]), "expf")

    def build(name: str, ret: ir.Type, args: list[ir.Type]):
        fn = ir.Function(m, ir.FunctionType(ret, args), name)
        b = ir.IRBuilder(fn.append_basic_block("entry"))

        def loop(n, body, init):
            """for i in 0..n with one value carried: returns the final value."""
            pre = b.block
            head, bodyb, done = (fn.append_basic_block(s) for s in ("head", "body", "done"))
            b.branch(head)
            b.position_at_end(head)
            i = b.phi(i64)
            acc = b.phi(init.type)
            i.add_incoming(ir.Constant(i64, 0), pre)
            acc.add_incoming(init, pre)
            b.cbranch(b.icmp_signed("<", i, n), bodyb, done)
            b.position_at_end(bodyb)
            new = body(i, acc)
            i.add_incoming(b.add(i, ir.Constant(i64, 1)), b.block)
            acc.add_incoming(new, b.block)
            b.branch(head)
            b.position_at_end(done)
            return acc

        return fn, b, loop

    def load(b, p, i):
        return b.load(b.gep(p, [i]))

    # lmc_exps(x, out, n, m): out[i] = expf(x[i] - m); with ``vector_exp`` 8 lanes
    # at a time (``vector_expf``), the tail by the library's expf
    fn, b, loop = build("lmc_exps", ir.VoidType(), [fp, fp, i64, f32])
    x, out, n, mx = fn.args
    start = ir.Constant(i64, 0)
    if vector_exp:
        v8 = ir.VectorType(f32, 8)

        def vex(i, a):
            at = b.mul(i, ir.Constant(i64, 8))
            xv = b.load(b.bitcast(b.gep(x, [at]), ir.PointerType(v8)), align=4)
            b.store(vector_expf(m, b, b.fsub(xv, splat(b, mx, 8))), b.bitcast(b.gep(out, [at]), ir.PointerType(v8)),
                    align=4)
            return a

        loop(b.lshr(n, ir.Constant(i64, 3)), vex, ir.Constant(f32, 0.0))
        start = b.and_(n, ir.Constant(i64, -8))

    def ex(i, a):
        j = b.add(i, start)
        b.store(b.call(expf, [b.fsub(load(b, x, j), mx)]), b.gep(out, [j]))
        return a

    loop(b.sub(n, start), ex, ir.Constant(f32, 0.0))
    b.ret_void()
    lmc_exps = fn

    def exps(b, loop, x, out, n):
        """out[i] = expf(x[i] - max x); returns their sequential float sum."""
        def larger(v, a):
            return b.select(b.fcmp_ordered(">", v, a), v, a)

        # the maximum 8 lanes at a time, then across the lanes and the tail: the
        # same value as one chain (a lane keeps its value over NaN as the chain
        # does; of +0 and -0 it may keep the other, and x - m is the same either way)
        v8 = ir.VectorType(f32, 8)
        n8 = b.and_(n, ir.Constant(i64, -8))

        def vload(i):
            return b.load(b.bitcast(b.gep(x, [b.mul(i, ir.Constant(i64, 8))]), ir.PointerType(v8)), align=4)

        vmax = loop(b.lshr(n, ir.Constant(i64, 3)), lambda i, a: larger(vload(i), a),
                    splat(b, load(b, x, ir.Constant(i64, 0)), 8))
        mx = b.extract_element(vmax, ir.Constant(ir.IntType(32), 0))
        for lane in range(1, 8):
            mx = larger(b.extract_element(vmax, ir.Constant(ir.IntType(32), lane)), mx)
        mx = loop(b.sub(n, n8), lambda i, a: larger(load(b, x, b.add(i, n8)), a), mx)
        b.call(lmc_exps, [x, out, n, mx])
        return loop(n, lambda i, s_: b.fadd(s_, load(b, out, i)), ir.Constant(f32, 0.0))

    # lmc_softmax(x, out, n): out = softmax(x)
    fn, b, loop = build("lmc_softmax", ir.VoidType(), [fp, fp, i64])
    x, out, n = fn.args
    total = exps(b, loop, x, out, n)

    def div(i, a):
        b.store(b.fdiv(load(b, out, i), total), b.gep(out, [i]))
        return a

    loop(n, div, ir.Constant(f32, 0.0))
    b.ret_void()

    # lmc_sample_mult(x, scratch, n, coin) -> i: run.c's softmax then sample_mult
    # (cdf += p[i]; the first i with coin < cdf, else n - 1), each p[i] = e[i] / sum
    # divided only as far as the draw reads: the same floats, a pass less
    fn, b, loop = build("lmc_sample_mult", i64, [fp, fp, i64, f32])
    x, out, n, coin = fn.args
    total = exps(b, loop, x, out, n)
    pre = b.block
    head, body, found, done = (fn.append_basic_block(s) for s in ("dhead", "dbody", "found", "last"))
    b.branch(head)
    b.position_at_end(head)
    i = b.phi(i64)
    cdf = b.phi(f32)
    i.add_incoming(ir.Constant(i64, 0), pre)
    cdf.add_incoming(ir.Constant(f32, 0.0), pre)
    b.cbranch(b.icmp_signed("<", i, n), body, done)
    b.position_at_end(body)
    new = b.fadd(cdf, b.fdiv(load(b, out, i), total))
    i.add_incoming(b.add(i, ir.Constant(i64, 1)), body)
    cdf.add_incoming(new, body)
    b.cbranch(b.fcmp_ordered("<", coin, new), found, head)
    b.position_at_end(found)
    b.ret(i)
    b.position_at_end(done)
    b.ret(b.sub(n, ir.Constant(i64, 1)))

    # lmc_mask(x, out, words, n): out[i] = x[i] where bit i of the words (a grammar's
    # allowed tokens, llguidance's bitmask: bit i % 32 of word i / 32) is set, else
    # -inf; whole words 8 lanes at a time, the last partial word value by value
    i32 = ir.IntType(32)
    fn, b, loop = build("lmc_mask", ir.VoidType(), [fp, fp, ir.PointerType(i32), i64])
    x, out, words, n = fn.args
    v8, vi8 = ir.VectorType(f32, 8), ir.VectorType(i32, 8)
    lane = ir.Constant(vi8, list(range(8)))
    ninf = splat(b, ir.Constant(f32, float("-inf")), 8)

    def word(wi, a):
        w = load(b, words, wi)
        for g in range(4):
            at = b.add(b.mul(wi, ir.Constant(i64, 32)), ir.Constant(i64, 8 * g))
            bits = b.lshr(splat(b, b.lshr(w, ir.Constant(i32, 8 * g)), 8), lane)
            on = b.icmp_unsigned("!=", b.and_(bits, ir.Constant(vi8, [1] * 8)), ir.Constant(vi8, [0] * 8))
            xv = b.load(b.bitcast(b.gep(x, [at]), ir.PointerType(v8)), align=4)
            b.store(b.select(on, xv, ninf), b.bitcast(b.gep(out, [at]), ir.PointerType(v8)), align=4)
        return a

    loop(b.lshr(n, ir.Constant(i64, 5)), word, ir.Constant(f32, 0.0))
    n32 = b.and_(n, ir.Constant(i64, -32))

    def tail(i, a):
        j = b.add(i, n32)
        w = load(b, words, b.lshr(j, ir.Constant(i64, 5)))
        bit = b.and_(b.lshr(w, b.trunc(b.and_(j, ir.Constant(i64, 31)), i32)), ir.Constant(i32, 1))
        v = b.select(b.icmp_unsigned("!=", bit, ir.Constant(i32, 0)), load(b, x, j), ir.Constant(f32, float("-inf")))
        b.store(v, b.gep(out, [j]))
        return a

    loop(b.sub(n, n32), tail, ir.Constant(f32, 0.0))
    b.ret_void()
    return m


def splat(b, v, n: int):
    """v in each of n lanes."""
    import llvmlite.ir as ir

    t = ir.VectorType(v.type, n)
    one = b.insert_element(ir.Constant(t, ir.Undefined), v, ir.Constant(ir.IntType(32), 0))
    return b.shuffle_vector(one, ir.Constant(t, ir.Undefined), ir.Constant(ir.VectorType(ir.IntType(32), n), [0] * n))


def vector_expf(m, b, x):
    """glibc's expf (its x86-64 FMA build, as ``runtime.sampling.expf_glibc``
    reproduces it) on <8 x float>: the reduction k + r = x 32/ln2 by FMAs,
    2^(k/32) from the table, the cubic in double with FMAs, one rounding
    to float; then the special cases by the same thresholds. Bit for bit
    the library's result, 8 lanes at once instead of a call per value."""
    import llvmlite.ir as ir

    f32, f64, i64 = ir.FloatType(), ir.DoubleType(), ir.IntType(64)
    vd, vi, vf = ir.VectorType(f64, 8), ir.VectorType(i64, 8), ir.VectorType(f32, 8)
    fma = m.globals.get("llvm.fma.v8f64") or ir.Function(m, ir.FunctionType(vd, [vd, vd, vd]), "llvm.fma.v8f64")
    table = m.globals.get("lmc_exp2f_table")
    if table is None:
        tt = ir.ArrayType(i64, 32)
        table = ir.GlobalVariable(m, tt, "lmc_exp2f_table")
        table.global_constant = True
        table.linkage = "internal"
        table.initializer = ir.Constant(tt, [int(v) for v in EXP2F_TABLE])

    def cd(v: float):
        return ir.Constant(vd, [v] * 8)

    def ci(v: int):
        return ir.Constant(vi, [v] * 8)

    xd = b.fpext(x, vd)
    kd0 = b.call(fma, [cd(EXPF_INVLN2N), xd, cd(EXPF_SHIFT)])
    ki = b.bitcast(kd0, vi)
    kd = b.fsub(kd0, cd(EXPF_SHIFT))
    r = b.call(fma, [cd(EXPF_INVLN2N), xd, b.fsub(cd(-0.0), kd)])
    idx = b.and_(ki, ci(31))
    t = ir.Constant(vi, ir.Undefined)
    for lane in range(8):
        at = b.extract_element(idx, ir.Constant(ir.IntType(32), lane))
        t = b.insert_element(t, b.load(b.gep(table, [ir.Constant(i64, 0), at])), ir.Constant(ir.IntType(32), lane))
    sc = b.bitcast(b.add(t, b.shl(ki, ci(47))), vd)
    z = b.call(fma, [cd(EXPF_C0), r, cd(EXPF_C1)])
    r2 = b.fmul(r, r)
    y = b.call(fma, [cd(EXPF_C2), r, cd(1.0)])
    y = b.call(fma, [z, r2, y])
    out = b.fptrunc(b.fmul(y, sc), vf)

    def cf(v: float):
        return ir.Constant(vf, [float(v)] * 8)

    out = b.select(b.fcmp_ordered(">", x, cf(EXPF_OVERFLOW)), cf(float("inf")), out)
    out = b.select(b.fcmp_ordered("<", x, cf(EXPF_MAY_UNDERFLOW)), cf(2.0 ** -149), out)
    return b.select(b.fcmp_ordered("<", x, cf(EXPF_UNDERFLOW)), cf(0.0), out)


def vector_exp_here() -> bool:
    """``vector_expf`` is glibc's expf only where glibc runs its FMA build: x86-64
    Linux with glibc, on a CPU with FMA. Elsewhere each value calls the
    library's own expf."""
    import platform

    from .target import host_target

    return (platform.system() == "Linux" and platform.machine() == "x86_64"
            and platform.libc_ver()[0] == "glibc" and host_target().has("fma"))


@functools.cache
def _compiled():
    from .jit import LoadedCode

    code = LoadedCode(object_code(build_module(vector_exp_here())), shared=True)
    return (code, _FN(code.address("lmc_softmax")), _DRAW(code.address("lmc_sample_mult")),
            _EXPS(code.address("lmc_exps")), _MASK(code.address("lmc_mask")))


def prepare() -> None:
    """Put the object code in the compile cache now (``lmc compile``, the
    compile child of a memory budget), so that a run under a budget never
    starts LLVM to sample: LLVM alone takes ~75 MB."""
    try:
        object_code(build_module(vector_exp_here()))
    except Exception:  # no LLVM target for this machine: sampling falls back to numpy
        pass


def object_code(m) -> bytes:
    """The module's object code, from the compile cache when this IR was
    compiled for this CPU with this llvmlite before (so sampling does not
    load LLVM on a warm start)."""
    import hashlib
    import os

    import llvmlite

    from ..cache import cache_dir
    from .jit import emit_object
    from .target import host_target

    t = host_target()
    m.triple = t.triple
    key = hashlib.sha256("\n".join([str(m), t.cpu, t.features, t.triple, llvmlite.__version__, "O2"]).encode())
    path = os.path.join(cache_dir(), "native", f"softmax-{key.hexdigest()[:32]}.o")
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        pass
    obj = emit_object(m, t, level=2)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.part"
        with open(tmp, "wb") as f:
            f.write(obj)
        os.replace(tmp, path)
    except OSError:
        pass  # best effort: compiled again next time
    return obj


def _native(i: int):
    """Entry i of ``_compiled()``, or None if native code is not available
    here (no LLVM target for this machine: the callers fall back)."""
    try:
        return _compiled()[i]
    except Exception:
        return None


def native_softmax(x: np.ndarray) -> np.ndarray | None:
    """softmax of a float32 vector as run.c computes it, or None if native
    code is not available here (the caller then uses the numpy emulation)."""
    fn = _native(1)
    if fn is None:
        return None
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(x)
    fn(x.ctypes.data, out.ctypes.data, x.size)
    return out


def native_sample_mult(x: np.ndarray, coin: np.float32) -> int | None:
    """run.c's ``sample_mult(softmax(x), coin)``: the index of the first
    token whose running float32 sum of probabilities exceeds ``coin`` (else
    the last), with the same floats as ``native_softmax`` and a cumulative
    sum, at about half their cost (one pass fewer, and the draw stops where
    it lands). None if native code is not available here."""
    fn = _native(2)
    if fn is None:
        return None
    x = np.ascontiguousarray(x, dtype=np.float32)
    scratch = np.empty_like(x)
    return int(fn(x.ctypes.data, scratch.ctypes.data, x.size, float(coin)))


def native_exps(x: np.ndarray, m: float = 0.0) -> np.ndarray | None:
    """expf(x - m) per value as the softmax computes it (the library's
    expf, or ``vector_expf`` where that is the same), or None if native code is
    not available here."""
    fn = _native(3)
    if fn is None:
        return None
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(x)
    fn(x.ctypes.data, out.ctypes.data, x.size, float(m))
    return out


def mask_logits(x: np.ndarray, words: np.ndarray) -> np.ndarray:
    """A copy of the float32 logits with every token whose bit is clear in
    ``words`` (int32, bit i % 32 of word i // 32: llguidance's token
    bitmask) set to -inf: in native code where it is available, else numpy."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    words = np.ascontiguousarray(words, dtype=np.int32)
    if words.size * 32 < x.size:
        raise ValueError(f"a mask of {words.size * 32} bits for {x.size} logits")
    out = np.empty_like(x)
    fn = _native(4)
    if fn is not None:
        fn(x.ctypes.data, out.ctypes.data, words.ctypes.data, x.size)
        return out
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:x.size].astype(bool)
    np.copyto(out, x)
    out[~bits] = -np.inf
    return out
