"""Activation quantization of the integer path, in registers: a float row's
block of 32 (``q8``) or 256 (``q8k``) values as int8 quants and a scale,
the numbers of ``ir.int_dot.quantize_q8_rows`` / ``quantize_q8k_rows``.
The integer matmuls quantize their x with these, and the KV cache write
quantizes a q8 cache row with ``quantize_q8_block`` too (the same d and q)."""
from __future__ import annotations

import llvmlite.ir as ir

from ir.quant import ACT_BLOCK

from .emit import F32, KernelBuilder
from .simd import HALF, I8, I16, I32, call, shuffle

QK = ACT_BLOCK["q8"]
QK_K = ACT_BLOCK["q8k"]


def quantize_q8_block(kb: KernelBuilder, at: ir.Value, x: ir.Value | None = None
                      ) -> tuple[ir.Value, ir.Value, ir.Value]:
    """The 32 values of x (input 0, or the float rows ``x``) at float index ``at`` as a q8 block
    (``ir.int_dot.quantize_q8_rows``): <32 x i8> quants, d_x (a float16 value as
    float32) and the int32 sum of the quants."""
    b = kb.b
    xv = kb.vload(kb.in_f32(0) if x is None else x, at, QK)
    amax = kb.hmax(kb.intrinsic("llvm.fabs", [xv]))
    d = b.fpext(b.fptrunc(b.fdiv(amax, ir.Constant(F32, 127.0)), HALF), F32)
    inv = b.select(b.fcmp_ordered(">", amax, ir.Constant(F32, 0.0)),
                   b.fdiv(ir.Constant(F32, 127.0), amax), ir.Constant(F32, 0.0))
    r = kb.intrinsic("llvm.roundeven", [b.fmul(xv, kb.splat(inv, QK))])
    q = b.fptosi(r, ir.VectorType(I8, QK))
    sx = call(kb, "llvm.vector.reduce.add.v32i32", I32, [b.sext(q, ir.VectorType(I32, QK))])
    return q, d, sx


def quantize_q8k_block(kb: KernelBuilder, at: ir.Value,
                       x: ir.Value | None = None) -> tuple[ir.Value, ir.Value, ir.Value]:
    """The 256 values of x (input 0, or the float rows ``x``) at float index ``at`` as a Q8_K block
    (``ir.int_dot.quantize_q8k_rows``): <256 x i8> quants, float32 d_x,
    and the <16 x i16> sums of 16 consecutive quants."""
    b = kb.b
    zero = ir.Constant(F32, 0.0)
    xv = kb.vload(kb.in_f32(0) if x is None else x, at, QK_K)
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
        v = b.add(shuffle(b, v, None, lo), shuffle(b, v, None, [i + h for i in lo]))
        g = h
    return q, d, v
