"""run.c's softmax (and its draw, ``sample_mult``) in native code, calling
the C library's own ``expf``.

The numpy emulation of glibc's expf in ``sampling`` is exact but costs
milliseconds per token at a 32000-token vocabulary; this calls the real
``expf`` in a compiled loop (no fast-math: the same operations in the same
order as run.c: max, expf(x - max), sequential float sum, divide), so it is
exact and fast. Compiled once per process, on first use.
"""
from __future__ import annotations

import ctypes
import functools

import numpy as np

_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
_DRAW = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float)


def _module():
    """The softmax loop and the fused softmax-and-draw as an LLVM module."""
    import llvmlite.ir as ir

    f32, i64 = ir.FloatType(), ir.IntType(64)
    fp = ir.PointerType(f32)
    m = ir.Module("softmax")
    expf = ir.Function(m, ir.FunctionType(f32, [f32]), "expf")

    def build(name: str, ret: ir.Type, args: list[ir.Type]):
        fn = ir.Function(m, ir.FunctionType(ret, args), name)
        b = ir.IRBuilder(fn.append_basic_block("entry"))

        def loop(n, body, init):
            """for i in 0..n with one float carried: returns the final value."""
            pre = b.block
            head, bodyb, done = (fn.append_basic_block(s) for s in ("head", "body", "done"))
            b.branch(head)
            b.position_at_end(head)
            i = b.phi(i64)
            acc = b.phi(f32)
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

    def exps(b, loop, x, out, n):
        """out[i] = expf(x[i] - max x); returns their sequential float sum."""
        mx = loop(n, lambda i, a: b.select(b.fcmp_ordered(">", load(b, x, i), a), load(b, x, i), a),
                  load(b, x, ir.Constant(i64, 0)))

        def ex(i, s):
            e = b.call(expf, [b.fsub(load(b, x, i), mx)])
            b.store(e, b.gep(out, [i]))
            return b.fadd(s, e)

        return loop(n, ex, ir.Constant(f32, 0.0))

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
    return m


@functools.cache
def _compiled():
    from compiler.codegen.jit import LoadedCode

    code = LoadedCode(_object_code(_module()), shared=True)
    return code, _FN(code.address("lmc_softmax")), _DRAW(code.address("lmc_sample_mult"))


def prepare() -> None:
    """Put the object code in the compile cache now (``lmc compile``, the
    compile child of a memory budget), so that a run under a budget never
    starts LLVM to sample: LLVM alone takes ~75 MB."""
    try:
        _object_code(_module())
    except Exception:  # no LLVM target for this machine: sampling falls back to numpy
        pass


def _object_code(m) -> bytes:
    """The module's object code, from the compile cache when this IR was
    compiled for this CPU with this llvmlite before (so sampling does not
    load LLVM on a warm start)."""
    import hashlib
    import os

    import llvmlite

    from compiler.cache import cache_dir
    from compiler.codegen.jit import emit_object
    from compiler.codegen.target import host_target

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


def native_softmax(x: np.ndarray) -> np.ndarray | None:
    """softmax of a float32 vector as run.c computes it, or None if native
    code is not available here (the caller then uses the numpy emulation)."""
    try:
        _, fn, _ = _compiled()
    except Exception:  # no LLVM target for this machine: fall back
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
    try:
        _, _, fn = _compiled()
    except Exception:  # no LLVM target for this machine: fall back
        return None
    x = np.ascontiguousarray(x, dtype=np.float32)
    scratch = np.empty_like(x)
    return int(fn(x.ctypes.data, scratch.ctypes.data, x.size, float(coin)))
