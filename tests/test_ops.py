"""Every op's numpy reference against an independent formula.

The independent versions are written the slow, obvious way (Python loops,
float64) straight from the maths, so a slip in the vectorised reference
shows up as a mismatch.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ir import ops
from ir.quant import get_layout, planar_q8
from ir.ops import WeightData
from ir.types import TensorType

rng = np.random.default_rng(0)


def f32w(a: np.ndarray) -> WeightData:
    a = np.ascontiguousarray(a, dtype="<f4")
    return WeightData(a.view(np.uint8).reshape(-1), TensorType(a.shape, "f32", "F32"))


def close(a, b, tol=1e-5):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(1.0, float(np.abs(b).max()) if b.size else 1.0)
    np.testing.assert_allclose(a, b, atol=tol * scale, rtol=tol)


@given(st.integers(1, 5), st.integers(1, 40), st.integers(1, 3))
@settings(max_examples=30, deadline=None)
def test_rmsnorm(rows, n, chunks):
    x = rng.standard_normal((rows, n * chunks)).astype(np.float32)
    w = rng.standard_normal(n).astype(np.float32)
    out = ops.rmsnorm_ref(x, f32w(w), eps=1e-5)
    for r in range(rows):
        for c in range(chunks):
            seg = [float(v) for v in x[r, c * n:(c + 1) * n]]
            inv = 1.0 / math.sqrt(sum(v * v for v in seg) / n + 1e-5)
            close(out[r, c * n:(c + 1) * n], [w[j] * seg[j] * inv for j in range(n)])


@given(st.integers(1, 4), st.integers(1, 33), st.integers(1, 17))
@settings(max_examples=30, deadline=None)
def test_matmul(t, k, n):
    x = rng.standard_normal((t, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    out = ops.matmul_ref(x, f32w(w))
    expect = [[sum(float(x[i, j]) * float(w[o, j]) for j in range(k)) for o in range(n)] for i in range(t)]
    close(out, expect)
    close(ops.matmul_ref(x[0], f32w(w)), expect[0])


def test_planar_q8_dequant_and_qmatmul():
    g, n, k = 8, 6, 16
    q = rng.integers(-127, 128, size=n * k).astype(np.int8)
    s = rng.uniform(0.001, 2.0, size=n * k // g).astype("<f4")
    raw = np.frombuffer(q.tobytes() + s.tobytes(), np.uint8)
    t = TensorType((n, k), "f32", planar_q8(g))
    assert get_layout(t.layout).nbytes(t.shape) == raw.size
    w = WeightData(raw, t)
    expect = np.array([[float(q[r * k + c]) * float(s[(r * k + c) // g]) for c in range(k)] for r in range(n)])
    close(ops.dequant_ref(w), expect)
    close(w.rows(np.array([4, 1])), expect[[4, 1]])
    x = rng.standard_normal(k).astype(np.float32)
    close(ops.qmatmul_ref(x, w, layout=t.layout), expect @ x)


def test_embedding():
    table = rng.standard_normal((10, 4)).astype(np.float32)
    ids = np.array([3, 0, 9], np.int32)
    close(ops.embedding_ref(f32w(table), ids), table[[3, 0, 9]])
    close(ops.embedding_ref(f32w(table), np.int32(7)), table[7])
    with pytest.raises(IndexError):
        ops.embedding_ref(f32w(table), np.array([10], np.int32))


@pytest.mark.parametrize("style", ["interleaved", "neox"])
@given(t=st.integers(1, 3), heads=st.integers(1, 3), half=st.integers(1, 6), pos=st.integers(0, 300))
@settings(max_examples=25, deadline=None)
def test_rope(style, t, heads, half, pos):
    hd = 2 * half
    x = rng.standard_normal((t, heads * hd)).astype(np.float32)
    out = ops.rope_ref(x, np.int32(pos), head_dim=hd, theta=10000.0, style=style)
    expect = np.array(x, np.float64)
    for r in range(t):
        p = pos + r
        for h in range(heads):
            for i in range(half):
                ang = p * 10000.0 ** (-(2 * i) / hd)
                a, b = (h * hd + 2 * i, h * hd + 2 * i + 1) if style == "interleaved" else (h * hd + i, h * hd + i + half)
                xa, xb = float(x[r, a]), float(x[r, b])
                expect[r, a] = xa * math.cos(ang) - xb * math.sin(ang)
                expect[r, b] = xa * math.sin(ang) + xb * math.cos(ang)
    close(out, expect, tol=2e-4)


def _llama_cpp_angle(p: int, i: int, hd: int, theta: float, ff: float, freq_scale: float, ext: float,
                     orig_ctx: int) -> tuple[float, float]:
    """Angle and magnitude of pair i at position p, in float64, written from
    llama.cpp's description of ggml_rope_cache_init / rope_yarn /
    ggml_rope_yarn_corr_dims (beta_fast 32, beta_slow 1)."""
    extrap = p * theta ** (-2 * i / hd) / ff
    angle, mscale = freq_scale * extrap, 1.0
    if ext:
        def corr(beta: float) -> float:
            return hd * math.log(orig_ctx / (beta * 2 * math.pi)) / (2 * math.log(theta))
        lo, hi = max(0, math.floor(corr(32.0))), min(hd - 1, math.ceil(corr(1.0)))
        ramp = 1 - min(1.0, max(0.0, (i - lo) / max(0.001, hi - lo)))
        mix = ramp * ext
        angle = angle * (1 - mix) + extrap * mix
        mscale *= 1 + 0.1 * math.log(1 / freq_scale)
    return angle, mscale


@pytest.mark.parametrize("factors,scale,ext", [(True, 1.0, 0.0), (False, 0.25, 0.0), (False, 0.25, 1.0),
                                               (True, 0.125, 1.0)])
def test_rope_scaled(factors, scale, ext):
    hd, heads, pos = 16, 2, 777
    ff = np.linspace(1.0, 8.0, hd // 2).astype(np.float32) if factors else None
    x = rng.standard_normal((3, heads * hd)).astype(np.float32)
    attrs = dict(freq_scale=scale, ext_factor=ext, yarn_orig_ctx=256)
    w = None if ff is None else ops.WeightData(ff.view(np.uint8), TensorType((hd // 2,), "f32", "F32"))
    out = ops.rope_ref(x, np.int32(pos), w, head_dim=hd, theta=10000.0, style="neox", **attrs)
    expect = np.array(x, np.float64)
    for r in range(3):
        for h in range(heads):
            for i in range(hd // 2):
                ang, ms = _llama_cpp_angle(pos + r, i, hd, 10000.0, 1.0 if ff is None else float(ff[i]), scale,
                                           ext, 256)
                a, b = h * hd + i, h * hd + i + hd // 2
                xa, xb = float(x[r, a]), float(x[r, b])
                expect[r, a] = (xa * math.cos(ang) - xb * math.sin(ang)) * ms
                expect[r, b] = (xa * math.sin(ang) + xb * math.cos(ang)) * ms
    close(out, expect, tol=2e-3)
    plain = ops.rope_ref(x, np.int32(pos), head_dim=hd, theta=10000.0, style="neox")
    assert np.abs(out - plain).max() > 0.1  # the scaling did something


def test_kv_write_in_place_and_bounds():
    cache = np.zeros((5, 3), np.float32)
    x = rng.standard_normal((2, 3)).astype(np.float32)
    out = ops.kv_write_ref(cache, x, np.int32(2))
    assert out is cache
    close(cache[2:4], x)
    assert not cache[[0, 1, 4]].any()
    with pytest.raises(IndexError):
        ops.kv_write_ref(cache, x, np.int32(4))


@given(t=st.integers(1, 4), past=st.integers(0, 6), kvh=st.integers(1, 2), group=st.integers(1, 3),
       hd=st.integers(1, 5), window=st.integers(0, 4))
@settings(max_examples=30, deadline=None)
def test_attention(t, past, kvh, group, hd, window):
    h = kvh * group
    S = past + t + 2
    kc = rng.standard_normal((S, kvh * hd)).astype(np.float32)
    vc = rng.standard_normal((S, kvh * hd)).astype(np.float32)
    q = rng.standard_normal((t, h * hd)).astype(np.float32)
    scale = 1 / math.sqrt(hd)
    out = ops.attention_ref(q, kc, vc, np.int32(past), n_heads=h, n_kv_heads=kvh, head_dim=hd,
                            scale=scale, window=window)
    for r in range(t):
        p = past + r
        lo = max(0, p - window + 1) if window else 0
        for head in range(h):
            kv = head // group
            sc = [scale * sum(float(q[r, head * hd + d]) * float(kc[j, kv * hd + d]) for d in range(hd))
                  for j in range(lo, p + 1)]
            m = max(sc)
            e = [math.exp(s - m) for s in sc]
            z = sum(e)
            for d in range(hd):
                val = sum(e[j - lo] / z * float(vc[j, kv * hd + d]) for j in range(lo, p + 1))
                assert abs(out[r, head * hd + d] - val) < 1e-4 * max(1, abs(val))


def test_elementwise():
    a = rng.standard_normal(50).astype(np.float32) * 4
    b = rng.standard_normal(50).astype(np.float32)
    close(ops.add_ref(a, b), [float(x) + float(y) for x, y in zip(a, b)])
    close(ops.mul_ref(a, b), [float(x) * float(y) for x, y in zip(a, b)])
    close(ops.silu_ref(a), [float(x) / (1 + math.exp(-float(x))) for x in a])
    close(ops.gelu_tanh_ref(a), [0.5 * x * (1 + math.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
                                 for x in map(float, a)])
    close(ops.scale_ref(a, factor=8.0), [8.0 * float(x) for x in a])
    m = rng.standard_normal((3, 4)).astype(np.float32)
    close(ops.take_last_ref(m), m[2])


def test_shape_rules_reject_misfits():
    with pytest.raises(ops.ShapeError):
        ops.get_op("matmul").infer([TensorType((5,)), TensorType((3, 4), "f32", "F32")], {})
    with pytest.raises(ops.ShapeError):
        ops.get_op("add").infer([TensorType((5,)), TensorType((4,))], {})
    with pytest.raises(ops.ShapeError):
        ops.get_op("rope").infer([TensorType((6,)), TensorType((), "i32")], {"head_dim": 4, "style": "neox"})
    t = ops.get_op("matmul").infer([TensorType(("T", 4)), TensorType((3, 4), "f32", "F32")], {})
    assert t == TensorType(("T", 3))


def test_bias_add_broadcasts_over_rows():
    a = rng.standard_normal((3, 5)).astype(np.float32)
    b = rng.standard_normal(5).astype(np.float32)
    out = ops.bias_add_ref(a, f32w(b))
    close(out, [[float(a[i, j]) + float(b[j]) for j in range(5)] for i in range(3)])
    with pytest.raises(ops.ShapeError):
        ops.get_op("bias_add").infer([TensorType((3, 5)), TensorType((4,), "f32", "F32")], {})
