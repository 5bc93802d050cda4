"""Elementwise kernels: add, mul, scale, silu, gelu_tanh, softcap, glu
(act(gate) * up).

Each thread takes a contiguous share of the elements; the body is a plain
loop over float32 that LLVM vectorizes. exp is
the inline ``exp_poly``: a libm ``expf`` call per element would keep the
loop scalar (SiLU cost 5 ns an element that way). The arithmetic is strict
(no fast-math flags): an element's bits must not depend on whether it falls
in the vectorized body or the scalar remainder, which the thread share and
the row count decide."""
from __future__ import annotations

import math

import llvmlite.ir as ir

from .emit import F32, KernelBuilder, exp_poly, f32c, i64
from .kernels import KernelSig, kernel


def _numel(kb: KernelBuilder, sig: KernelSig):
    shape = sig.out_type.shape
    return kb.b.mul(kb.rows_of(shape), i64(int(shape[-1])))


def _activation(kb: KernelBuilder, act: str, x: ir.Value) -> ir.Value:
    b = kb.b
    if act == "silu":
        e = exp_poly(kb, b.fsub(f32c(0.0), x))
        return b.fdiv(x, b.fadd(f32c(1.0), e))
    # gelu_tanh: 0.5 x (1 + tanh(c (x + 0.044715 x^3)))
    inner = b.fmul(f32c(math.sqrt(2.0 / math.pi)),
                   b.fadd(x, b.fmul(f32c(0.044715), b.fmul(x, b.fmul(x, x)))))
    th = kb.tanh(inner)
    return b.fmul(b.fmul(f32c(0.5), x), b.fadd(f32c(1.0), th))


@kernel("add", "mul", "scale", "silu", "gelu_tanh", "softcap", "glu")
def emit_elementwise(kb: KernelBuilder, sig: KernelSig) -> None:
    b = kb.b
    lo, hi = kb.thread_share(_numel(kb, sig))
    out = kb.out_f32()
    a = kb.in_f32(0)
    other = kb.in_f32(1) if sig.op in ("add", "mul", "glu") else None
    with kb.loop(lo, hi) as i:
        x = kb.load(a, i)
        if sig.op == "add":
            y = b.fadd(x, kb.load(other, i))
        elif sig.op == "mul":
            y = b.fmul(x, kb.load(other, i))
        elif sig.op == "scale":
            y = b.fmul(x, f32c(sig.attr["factor"]))
        elif sig.op == "softcap":  # cap * tanh(x / cap)
            cap = float(sig.attr["cap"])
            y = b.fmul(kb.tanh(b.fmul(x, f32c(1.0 / cap))), f32c(cap))
        elif sig.op == "glu":   # act(x) is rounded first, as the two ops it replaces
            y = b.fmul(_activation(kb, sig.attr["activation"], x), kb.load(other, i))
        else:
            y = _activation(kb, sig.op, x)
        kb.store(y, out, i)


@kernel("bias_add")
def emit_bias_add(kb: KernelBuilder, sig: KernelSig) -> None:
    """out[r, c] = a[r, c] + bias[c]; rows split between threads. The bias is
    F32 or F16 (QSF stores vectors as F16), widened as it is loaded."""
    b = kb.b
    n = int(sig.out_type.shape[-1])
    lo, hi = kb.thread_share(kb.rows_of(sig.out_type.shape))
    out, a = kb.out_f32(), kb.in_f32(0)
    bt = sig.in_types[1]
    if (bt.layout or "F32") == "F16" or bt.dtype == "f16":
        hp = b.bitcast(kb.in_raw[1], ir.PointerType(ir.HalfType()))
        bias_at = lambda c: b.fpext(kb.load(hp, c), F32)  # noqa: E731
    elif (bt.layout or "F32") == "F32":
        bp = kb.in_f32(1)
        bias_at = lambda c: kb.load(bp, c)  # noqa: E731
    else:
        raise NotImplementedError(f"bias_add: bias layout {bt.layout} (dequantize it first)")
    with kb.loop(lo, hi, name="row") as r:
        base = b.mul(r, i64(n))
        with kb.loop(0, n, name="col") as c:
            i = b.add(base, c)
            kb.store(b.fadd(kb.load(a, i), bias_at(c)), out, i)
