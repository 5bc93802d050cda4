"""The kernel of repacked weights (``compiler/codegen/matmul/repacked.py``):
one arithmetic for every row count. A decode row, a prompt chunk and a batch
give each token the same bits, equal to the integer GEMM's on the file's
layout (the same operations on the same numbers) and within the integer
path's tolerance of the reference."""
from __future__ import annotations

import re

import numpy as np
import pytest

from compiler.codegen.harness import CompiledKernel, sig_for
from compiler.codegen.jit import emit_assembly
from compiler.codegen.target import vnni_width
from compiler.codegen.target import host_target
from ir.quant import layout_of
from ir.quant.repack import REPACKABLE
from ir.ops import WeightData
from ir.types import TensorType
from kernel_checks import call_with_guard
from test_int_gemm import act, check_close, gemm_kernel, weight

_KERNELS: dict = {}


def width_or_skip(vw: int | None) -> int:
    w = vnni_width(vw or host_target().vector_width)
    if w is None:
        pytest.skip("no VNNI at this width")
    return w


def repacked(w: WeightData, width: int) -> WeightData:
    n, k = (int(d) for d in w.type.shape)
    t = TensorType((n, k), "f32", w.type.layout, width)
    raw = layout_of(t).repack(np.asarray(w.raw), n, k)
    return WeightData(raw, t)


def kernel(x_shape: tuple, wt: TensorType, **attrs) -> CompiledKernel:
    sig = sig_for("qmatmul", [TensorType(x_shape), wt], layout=wt.layout, act=act(wt.layout),
                  **attrs)
    if sig not in _KERNELS:
        _KERNELS[sig] = CompiledKernel(sig)
    return _KERNELS[sig]


def shapes(base: str) -> tuple:
    return ((16, 256), (48, 1280), (32, 2048)) if base.endswith("_K") else ((16, 96), (48, 1056), (32, 2048))


@pytest.mark.parametrize("vw", [None, 8])
@pytest.mark.parametrize("base", REPACKABLE)
def test_every_row_count_gives_the_gemm_bits(base: str, vw: int | None) -> None:
    """Odd tile counts per thread, a K chunk and a tail, 1-3 threads, more
    tokens than a call quantizes at once: each token's row equals the
    integer GEMM's on the file's layout bit for bit, the decode step's (x
    of one row) equals its row of any chunk, and all agree with the
    reference within the integer path's tolerance."""
    W = width_or_skip(vw)
    rng = np.random.default_rng(41)
    for n, k in shapes(base):
        w = weight(rng, base, n, k)
        wr = repacked(w, W)
        x = rng.standard_normal((70, k)).astype(np.float32)
        x[3, :32] = 0.0                                    # a zero block
        gemm = call_with_guard(gemm_kernel(k, w.type, vw), x, w, 70, 2)
        chunk = kernel(("T", k), wr.type)
        for nt in (1, 2, 3):
            got = call_with_guard(chunk, x, wr, 70, nt)
            np.testing.assert_array_equal(got, gemm)
        check_close(got, x, w)
        for T, at in ((1, 0), (3, 5), (17, 40)):
            np.testing.assert_array_equal(call_with_guard(chunk, x[at:at + T], wr, T, 2), gemm[at:at + T])
        one = kernel((k,), wr.type)
        for t in (0, 3, 69):
            np.testing.assert_array_equal(call_with_guard(one, x[t], wr, 1, 3), gemm[t])


@pytest.mark.parametrize("base", ["Q5_0", "Q4_K", "Q6_K"])
def test_tuning_does_not_change_the_bits(base: str) -> None:
    """Tokens per register block, K chunk and prefetch distance change the
    schedule, never a row's numbers."""
    W = width_or_skip(None)
    rng = np.random.default_rng(42)
    n, k = 32, (1280 if base.endswith("_K") else 1056)
    wr = repacked(weight(rng, base, n, k), W)
    x = rng.standard_normal((23, k)).astype(np.float32)
    want = call_with_guard(kernel(("T", k), wr.type), x, wr, 23, 2)
    for attrs in ({"tokens": 3}, {"kc": 3}, {"tokens": 1, "kc": 33}, {"prefetch": 0}):
        np.testing.assert_array_equal(call_with_guard(kernel(("T", k), wr.type, **attrs), x, wr, 23, 2), want)


@pytest.mark.parametrize("base,n,k", [("Q5_0", 4864, 896), ("Q6_K", 896, 4864), ("Q8_0", 2048, 640)])
def test_model_sized_weights(base: str, n: int, k: int) -> None:
    W = width_or_skip(None)
    rng = np.random.default_rng(43)
    w = weight(rng, base, n, k)
    wr = repacked(w, W)
    x = rng.standard_normal((5, k)).astype(np.float32)
    got = call_with_guard(kernel(("T", k), wr.type), x, wr, 5, 2)
    check_close(got, x, w)
    np.testing.assert_array_equal(call_with_guard(kernel((k,), wr.type), x[4], wr, 1, 2), got[4])


@pytest.mark.parametrize("base", ["Q5_0", "Q4_K"])
def test_decode_kernel_is_vnni_on_broadcast_activations(base: str) -> None:
    W = width_or_skip(None)
    asm = emit_assembly(kernel((1024,), TensorType((64, 1024), "f32", base, W)).module)
    assert re.findall(rf"vpdpbusd\s+[^\n]*\{{1to{W}\}}", asm), asm[:2000]
