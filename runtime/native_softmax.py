"""run.c's softmax in native code, calling the C library's own ``expf``.

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


def _module():
    """The softmax loop as an LLVM module."""
    import llvmlite.ir as ir

    f32, i64 = ir.FloatType(), ir.IntType(64)
    fp = ir.PointerType(f32)
    m = ir.Module("softmax")
    expf = ir.Function(m, ir.FunctionType(f32, [f32]), "expf")
    fn = ir.Function(m, ir.FunctionType(ir.VoidType(), [fp, fp, i64]), "lmc_softmax")
    x, out, n = fn.args
    entry = fn.append_basic_block("entry")
    b = ir.IRBuilder(entry)

    def loop(body, init):
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

    def load(p, i):
        return b.load(b.gep(p, [i]))

    mx = loop(lambda i, a: b.select(b.fcmp_ordered(">", load(x, i), a), load(x, i), a), load(x, ir.Constant(i64, 0)))

    def ex(i, s):
        e = b.call(expf, [b.fsub(load(x, i), mx)])
        b.store(e, b.gep(out, [i]))
        return b.fadd(s, e)

    total = loop(ex, ir.Constant(f32, 0.0))

    def div(i, a):
        b.store(b.fdiv(load(out, i), total), b.gep(out, [i]))
        return a

    loop(div, ir.Constant(f32, 0.0))
    b.ret_void()
    return m


@functools.cache
def _compiled():
    from compiler.codegen.jit import LoadedCode

    code = LoadedCode(_object_code(_module()), shared=True)
    return code, _FN(code.address("lmc_softmax"))


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
        _, fn = _compiled()
    except Exception:  # no LLVM target for this machine: fall back
        return None
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(x)
    fn(x.ctypes.data, out.ctypes.data, x.size)
    return out
