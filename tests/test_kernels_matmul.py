"""Native matmul / qmatmul / embedding kernels against the op references.

Each kernel is compiled for one signature and called once per thread id
(serially), as the step function would; the union of the shares must equal
the numpy reference to float32 rounding."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compiler.codegen.matmul import float_tiles
from compiler.codegen.harness import CompiledKernel, run_kernel_like_reference, sig_for
from compiler.codegen.jit import emit_assembly
from compiler.codegen.target import host_target
from ir.quant import get_layout, planar_q8
from ir.ops import WeightData, embedding_ref, matmul_ref, qmatmul_ref
from ir.types import TensorType
from kernel_checks import check_dot

_KERNELS: dict = {}
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def compiled(sig, vector_width=None) -> CompiledKernel:
    key = (sig, vector_width, float_tiles.K_CHUNK)
    if key not in _KERNELS:
        _KERNELS[key] = CompiledKernel(sig, vector_width=vector_width)
    return _KERNELS[key]


# --- operands ---------------------------------------------------------------------------
def f32_weight(a: np.ndarray) -> WeightData:
    a = np.ascontiguousarray(a, np.float32)
    return WeightData(a.view(np.uint8).reshape(-1), TensorType(a.shape, "f32", "F32"))


def q8_weight(rng: np.random.Generator, n: int, k: int, g: int, scales: str = "normal") -> WeightData:
    q = rng.integers(-127, 128, size=n * k).astype(np.int8)
    ns = n * k // g
    if scales == "normal":
        s = rng.uniform(0.001, 0.1, size=ns)
    elif scales == "extreme":  # 1e-30 .. 1e30, some exactly zero
        s = 10.0 ** rng.uniform(-30, 30, size=ns) * rng.choice([-1.0, 1.0], size=ns)
        s[rng.random(ns) < 0.2] = 0.0
    else:
        raise ValueError(scales)
    raw = np.frombuffer(q.tobytes() + s.astype("<f4").tobytes(), np.uint8)
    t = TensorType((n, k), "f32", planar_q8(g))
    assert get_layout(t.layout).nbytes(t.shape) == raw.size
    return WeightData(raw, t)




def run_matmul(x: np.ndarray, w: WeightData, nthreads: int, vector_width=None
               ) -> tuple[np.ndarray, np.ndarray]:
    k = int(w.type.shape[1])
    lay = w.type.layout
    xshape = (k,) if x.ndim == 1 else ("T", k)
    if lay == "F32":
        sig = sig_for("matmul", [TensorType(xshape), w.type])
        want = matmul_ref(x, w)
    else:
        sig = sig_for("qmatmul", [TensorType(xshape), w.type], layout=lay)
        want = qmatmul_ref(x, w, layout=lay)
    sym = {"T": x.shape[0]} if x.ndim == 2 else None
    got = run_kernel_like_reference(sig, [x, w], nthreads=nthreads, symbols=sym,
                                    kernel=compiled(sig, vector_width))
    return got, want


def activations(rng, t: int | None, k: int) -> np.ndarray:
    return rng.standard_normal((k,) if t is None else (t, k)).astype(np.float32)


tokens = st.one_of(st.none(), st.integers(1, 9))   # None: decode (x is [K])


# --- matmul, F32 ---------------------------------------------------------------------------
@settings(max_examples=30, **SETTINGS)
@given(n=st.integers(1, 70), k=st.integers(1, 200), t=tokens, nt=st.integers(1, 3), seed=st.integers(0, 2**31))
def test_matmul_f32(n, k, t, nt, seed):
    rng = np.random.default_rng(seed)
    w = f32_weight(rng.standard_normal((n, k)))
    x = activations(rng, t, k)
    got, want = run_matmul(x, w, nt)
    check_dot(got, want, x, w)


@pytest.mark.parametrize("n,k,t", [(1, 1, None), (1, 1, 1), (4, 16, None), (7, 33, 5), (64, 512, None),
                                   (33, 257, 9), (5, 1000, 4), (6, 2085, 5), (5, 3072, 9)])
def test_matmul_f32_edges(n, k, t):
    rng = np.random.default_rng(n * 1000 + k)
    w = f32_weight(rng.standard_normal((n, k)))
    x = activations(rng, t, k)
    for nt in (1, 2, 3):
        got, want = run_matmul(x, w, nt)
        check_dot(got, want, x, w)


@settings(max_examples=12, **SETTINGS)
@given(n=st.integers(1, 40), k=st.integers(1, 120), t=st.integers(1, 9), nt=st.integers(1, 3),
       layout=st.sampled_from(["F32", 16, 32]), seed=st.integers(0, 2**31))
def test_prefill_k_chunks(n, k, t, nt, layout, seed):
    """Prefill splits a long K into chunks (partial sums added in out); use
    a tiny chunk so that small shapes take that path."""
    rng = np.random.default_rng(seed)
    if layout == "F32":
        w = f32_weight(rng.standard_normal((n, k)))
    else:
        k = max(layout, k - k % layout)
        w = q8_weight(rng, n, k, layout)
    x = activations(rng, t, k)
    saved, float_tiles.K_CHUNK = float_tiles.K_CHUNK, 32
    try:
        got, want = run_matmul(x, w, nt)
    finally:
        float_tiles.K_CHUNK = saved
    check_dot(got, want, x, w)


@settings(max_examples=12, **SETTINGS)
@given(n=st.integers(1, 40), k=st.integers(1, 120), t=tokens, nt=st.integers(1, 3),
       vw=st.sampled_from([4, 8]), seed=st.integers(0, 2**31))
def test_matmul_narrow_vectors(n, k, t, nt, vw, seed):
    """The AVX2 / NEON shapes of the kernels (vector width 8 / 4, 3x3 or
    4x4 prefill tiles) run on any x86-64 host too."""
    rng = np.random.default_rng(seed)
    w = f32_weight(rng.standard_normal((n, k)))
    x = activations(rng, t, k)
    got, want = run_matmul(x, w, nt, vector_width=vw)
    check_dot(got, want, x, w)


# --- qmatmul, llama2.c planar Q8 --------------------------------------------------------------
@st.composite
def q8_shapes(draw, groups=(8, 16, 32, 64)):
    """(n, k, g) with n*k a multiple of g; k % g != 0 often (groups straddle rows)."""
    g = draw(st.sampled_from(groups))
    k = draw(st.integers(1, 200))
    step = g // math.gcd(k, g)           # n must be a multiple of this
    n = step * draw(st.integers(1, max(1, 70 // step)))
    return n, k, g


@settings(max_examples=40, **SETTINGS)
@given(shape=q8_shapes(), t=tokens, nt=st.integers(1, 3), scales=st.sampled_from(["normal", "extreme"]),
       seed=st.integers(0, 2**31))
def test_qmatmul_planar_q8(shape, t, nt, scales, seed):
    n, k, g = shape
    rng = np.random.default_rng(seed)
    w = q8_weight(rng, n, k, g, scales)
    x = activations(rng, t, k)
    got, want = run_matmul(x, w, nt)
    check_dot(got, want, x, w)


@pytest.mark.parametrize("n,k,g", [
    (2, 172, 8),      # 172 % 8 == 4: every other row starts mid-group
    (6, 172, 8), (8, 100, 32), (64, 97, 64), (3, 200, 40), (3, 16, 48),
    (5, 48, 48), (4, 96, 48), (4, 60, 24),    # groups that are not powers of two
    (5, 33, 1), (6, 34, 2), (7, 44, 4),       # tiny groups, K not a multiple of the vector width
    (4, 512, 256), (2, 256, 512),             # large groups (even wider than a row)
    (3, 7, 3),
    (5, 2112, 64), (4, 2100, 8),              # prefill splits K into chunks
])
@pytest.mark.parametrize("t", [None, 1, 6])
def test_qmatmul_planar_q8_cases(n, k, g, t):
    rng = np.random.default_rng(n * k + g)
    w = q8_weight(rng, n, k, g, "extreme" if t == 6 else "normal")
    x = activations(rng, t, k)
    for nt in (1, 3):
        got, want = run_matmul(x, w, nt)
        check_dot(got, want, x, w)


def test_qmatmul_zero_and_huge_scales():
    rng = np.random.default_rng(7)
    n, k, g = 6, 96, 16
    w = q8_weight(rng, n, k, g)
    s = w.raw[n * k:].view("<f4").copy()
    s[:] = 1e30
    s[1::3] = 0.0
    s[2::3] = 1e-30
    w = WeightData(np.concatenate([w.raw[: n * k], s.view(np.uint8)]), w.type)
    for t in (None, 5):
        x = activations(rng, t, k)
        got, want = run_matmul(x, w, 2)
        check_dot(got, want, x, w)


@settings(max_examples=10, **SETTINGS)
@given(shape=q8_shapes((4, 8, 16, 32)), t=tokens, vw=st.sampled_from([4, 8]), seed=st.integers(0, 2**31))
def test_qmatmul_narrow_vectors(shape, t, vw, seed):
    n, k, g = shape
    rng = np.random.default_rng(seed)
    w = q8_weight(rng, n, k, g)
    x = activations(rng, t, k)
    got, want = run_matmul(x, w, 2, vector_width=vw)
    check_dot(got, want, x, w)


def test_qmatmul_f16_layout():
    rng = np.random.default_rng(3)
    n, k = 9, 77
    a = rng.standard_normal((n, k)).astype("<f2")
    w = WeightData(a.view(np.uint8).reshape(-1), TensorType((n, k), "f32", "F16"))
    for t in (None, 5):
        x = activations(rng, t, k)
        got, want = run_matmul(x, w, 2)
        check_dot(got, want, x, w)


# --- embedding -------------------------------------------------------------------------------
def run_embedding(w: WeightData, ids: np.ndarray, nt: int) -> np.ndarray:
    ids = np.asarray(ids, np.int32)
    ishape = () if ids.ndim == 0 else ("T",)
    sig = sig_for("embedding", [w.type, TensorType(ishape, "i32")])
    sym = {"T": ids.shape[0]} if ids.ndim else None
    return run_kernel_like_reference(sig, [w, ids], nthreads=nt, symbols=sym, kernel=compiled(sig))


def embedding_want(w: WeightData, ids: np.ndarray) -> np.ndarray:
    want = embedding_ref(w, ids)
    # the reference's row lookup must agree with dequantizing the whole
    # table (groups may straddle rows when d % group != 0)
    np.testing.assert_array_equal(want, w.to_f32()[np.asarray(ids, np.int64)])
    return want


@settings(max_examples=30, **SETTINGS)
@given(v=st.integers(1, 50), d=st.integers(1, 200), t=tokens, nt=st.integers(1, 3),
       layout=st.sampled_from(["F32", 8, 16, 32, 64]), seed=st.integers(0, 2**31))
def test_embedding(v, d, t, nt, layout, seed):
    rng = np.random.default_rng(seed)
    if layout == "F32":
        w = f32_weight(rng.standard_normal((v, d)))
    else:
        g = layout
        v = g // math.gcd(d, g) * max(1, v // (g // math.gcd(d, g)))
        w = q8_weight(rng, v, d, g, "extreme")
    ids = rng.integers(0, v, size=() if t is None else (t,)).astype(np.int32)
    got = run_embedding(w, ids, nt)
    want = embedding_want(w, ids)
    # one multiply per value (or a copy): bit-exact
    np.testing.assert_array_equal(got, want)


# --- code quality -------------------------------------------------------------------------------
def test_matvec_assembly_has_vector_fma():
    target = host_target()
    if target.has("avx512f"):
        reg = "zmm"
    elif target.has("avx2") and target.has("fma"):
        reg = "ymm"
    elif "aarch64" in target.triple or "arm64" in target.triple:
        reg = None
    else:
        pytest.skip(f"host {target.cpu} has no AVX2+FMA, AVX-512 or NEON")
    k, n = 4096, 256
    sig = sig_for("matmul", [TensorType((k,)), TensorType((n, k), "f32", "F32")])
    asm = emit_assembly(compiled(sig).module)
    if reg is None:
        fmas = re.findall(r"\bfmla\s+v\d+\.4s", asm)
    else:
        fmas = re.findall(rf"\bvfmadd\w*ps\s[^\n]*%{reg}", asm)
    assert len(fmas) >= 8, asm[:3000]


# --- decode rows: T rows, each with the decode step's arithmetic --------------------------------
def _weight(rng, layout: str, n: int, k: int) -> WeightData:
    if layout == "F32":
        return f32_weight(rng.standard_normal((n, k)))
    if layout.startswith("Q8G"):
        return q8_weight(rng, n, k, int(layout[3:]))
    if layout.endswith("_K"):
        from test_kquants import kquant_weight
        return kquant_weight(rng, layout, n, k)
    from test_gguf_layouts import gguf_weight
    return gguf_weight(rng, layout, n, k)


@pytest.mark.parametrize("layout,n,k", [
    ("F32", 9, 200), ("F32", 5, 2048), ("Q8G32", 7, 96), ("Q8G32", 8, 100), ("Q8_0", 5, 2048),
    ("Q4_1", 33, 576), ("Q4_1", 3, 8192), ("Q5_1", 7, 160), ("Q4_K", 9, 512), ("Q6_K", 7, 2048)])
def test_decode_rows_equal_one_row_calls_bit_for_bit(layout, n, k):
    """``decode_rows`` (a batch of decode rows, ``passes/int_dot``): each
    row's result is the one-row (decode) kernel's, bit for bit, whatever T
    and the thread count; prefill tiles (several tokens, K chunks) would
    sum in another order. Planar Q8 with K % group != 0 too (rows straddle
    groups), long K (R = 4 rows; K chunks in prefill)."""
    rng = np.random.default_rng(31)
    w = _weight(rng, layout, n, k)
    op, attrs = ("matmul", {}) if layout == "F32" else ("qmatmul", {"layout": w.type.layout})
    one = compiled(sig_for(op, [TensorType((k,)), w.type], **attrs))
    rows = sig_for(op, [TensorType(("T", k)), w.type], **attrs, decode_rows=4)
    for T in (1, 4, 6, 11):
        x = activations(rng, T, k)
        for nt in (1, 3):
            got = run_kernel_like_reference(rows, [x, w], nthreads=nt, symbols={"T": T}, kernel=compiled(rows))
            want = np.stack([run_kernel_like_reference(one.sig, [x[t], w], nthreads=nt, kernel=one)
                             for t in range(T)])
            np.testing.assert_array_equal(got, want)
        ref = matmul_ref(x, w) if op == "matmul" else qmatmul_ref(x, w, layout=w.type.layout)
        check_dot(got, ref, x, w)
