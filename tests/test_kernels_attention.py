"""Native rmsnorm, rope, take_last, kv_write and attention kernels against the
``ir.ops`` numpy references.

Kernels are compiled once per (signature, vector width) and cached, so the
hypothesis examples mostly reuse them. Besides the host's vector width the
kernels are also built for 4 and 8 lanes (the SSE/NEON and AVX2 shapes of the
same code). Each run calls every thread id in turn (as the step function
would, but serially), starts from a NaN-filled output so an element no thread
wrote shows up, and checks that no kernel writes scratch past its
``scratch_floats``.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from compiler.codegen import k_attention, k_norm_rope
from compiler.codegen.emit import KernelBuilder, exp_poly, hsum_many, i64
from compiler.codegen.harness import CompiledKernel, sig_for
from compiler.codegen.kernels import EMITTERS, KernelSig
from compiler.codegen.target import host_target
from ir import ops
from ir.ops import WeightData
from ir.types import TensorType, f32, i32

HOST_VW = host_target().vector_width
WIDTHS = sorted({4, 8, HOST_VW})
_CACHE: dict[tuple[KernelSig, int], CompiledKernel] = {}
SENTINEL = np.float32(12345.0)


def compiled(sig: KernelSig, vw: int) -> CompiledKernel:
    key = (sig, vw)
    if key not in _CACHE:
        _CACHE[key] = CompiledKernel(sig, vector_width=vw)
    return _CACHE[key]


def weight(a: np.ndarray, layout: str = "F32") -> WeightData:
    a = np.ascontiguousarray(a, dtype="<f4" if layout == "F32" else "<f2")
    return WeightData(a.view(np.uint8).reshape(-1), TensorType(a.shape, "f32", layout))


def need_scratch(sig: KernelSig) -> int:
    return max(k_norm_rope.scratch_floats(sig), k_attention.scratch_floats(sig))


def run(sig: KernelSig, args, *, pos: int = 0, T: int = 1, nthreads: int = 1, vw: int = HOST_VW,
        out: np.ndarray | None = None) -> np.ndarray:
    k = compiled(sig, vw)
    if out is None:
        shape = tuple(T if isinstance(d, str) else d for d in sig.out_type.shape)
        out = np.full(shape, np.nan, np.float32)
    need = need_scratch(sig)
    scratch = np.full(need + 64, SENTINEL, np.float32)
    for tid in range(nthreads):
        k(out, args, pos=pos, T=T, tid=tid, nthreads=nthreads, scratch=scratch)
    assert (scratch[need:] == SENTINEL).all(), "kernel wrote past its scratch_floats"
    return out


def close(got, want, rtol=1e-5, atol=1e-5):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    assert np.isfinite(got).all(), "an output element was not written"
    scale = max(1.0, float(np.abs(want).max()) if want.size else 1.0)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol * scale)


rng = np.random.default_rng(1)
threads = st.integers(1, 3)
widths = st.sampled_from(WIDTHS)
rows_t = st.one_of(st.none(), st.integers(1, 6))  # None: a decode row without the T axis


def act_type(T: int | None, n: int) -> TensorType:
    return f32(n) if T is None else f32("T", n)


def act(T: int | None, n: int, s: float = 1.0) -> np.ndarray:
    shape = (n,) if T is None else (T, n)
    return (rng.standard_normal(shape) * s).astype(np.float32)


# --- rmsnorm ---------------------------------------------------------------------
@given(T=rows_t, m=st.sampled_from([1, 3, 8, 16, 24, 40, 64, 100, 256]), chunks=st.integers(1, 3),
       eps=st.sampled_from([1e-5, 1e-6]), layout=st.sampled_from(["F32", "F32", "F16"]), nt=threads, vw=widths)
@settings(deadline=None, max_examples=60)
def test_rmsnorm(T, m, chunks, eps, layout, nt, vw):
    n = m * chunks
    x = act(T, n, 3.0)
    w = weight(rng.standard_normal(m), layout)
    sig = sig_for("rmsnorm", [act_type(T, n), w.type], eps=eps)
    got = run(sig, [x, w], T=T or 1, nthreads=nt, vw=vw)
    close(got, ops.rmsnorm_ref(x, w, eps=eps))


# --- rope ------------------------------------------------------------------------
@given(T=rows_t, hd=st.sampled_from([2, 6, 8, 16, 24, 64, 128]), heads=st.integers(1, 3),
       pos=st.one_of(st.integers(0, 40), st.integers(0, 4000)), theta=st.sampled_from([10000.0, 500000.0]),
       style=st.sampled_from(["interleaved", "neox"]), nt=threads, vw=widths)
@settings(deadline=None, max_examples=80)
def test_rope(T, hd, heads, pos, theta, style, nt, vw):
    n = hd * heads
    x = act(T, n)
    sig = sig_for("rope", [act_type(T, n), i32()], head_dim=hd, theta=theta, style=style)
    got = run(sig, [x, pos], pos=pos, T=T or 1, nthreads=nt, vw=vw)
    close(got, ops.rope_ref(x, pos, head_dim=hd, theta=theta, style=style), rtol=0, atol=1e-5)


@given(T=rows_t, hd=st.sampled_from([8, 16, 64, 128]), heads=st.integers(1, 2),
       pos=st.one_of(st.integers(0, 40), st.integers(0, 9000)), style=st.sampled_from(["interleaved", "neox"]),
       factors=st.booleans(), scale=st.sampled_from([1.0, 0.25, 0.125]), yarn=st.booleans(),
       attn=st.sampled_from([1.0, 1.25]), nt=threads, vw=widths)
@settings(deadline=None, max_examples=60)
def test_rope_scaled(T, hd, heads, pos, style, factors, scale, yarn, attn, nt, vw):
    """Frequency factors (a weight input), linear and YaRN scaling, a
    magnitude factor: the kernel against the reference."""
    n = hd * heads
    x = act(T, n)
    attrs = dict(head_dim=hd, theta=500000.0, style=style, freq_scale=scale, attn_factor=attn)
    if yarn:
        attrs.update(ext_factor=1.0, yarn_orig_ctx=512)
    ins, args = [act_type(T, n), i32()], [x, pos]
    if factors:
        ff = weight(np.linspace(1.0, 8.0, hd // 2).astype(np.float32))
        ins.append(ff.type)
        args.append(ff)
    sig = sig_for("rope", ins, **attrs)
    got = run(sig, args, pos=pos, T=T or 1, nthreads=nt, vw=vw)
    close(got, ops.rope_ref(*args, **attrs), rtol=0, atol=1e-5)


# --- take_last -------------------------------------------------------------------
@given(T=st.integers(1, 6), n=st.integers(1, 50), nt=threads)
@settings(deadline=None, max_examples=30)
def test_take_last(T, n, nt):
    x = act(T, n)
    sig = sig_for("take_last", [f32("T", n)])
    got = run(sig, [x], T=T, nthreads=nt)
    np.testing.assert_array_equal(got, ops.take_last_ref(x))


# --- take_rows -------------------------------------------------------------------
@given(T=st.integers(1, 9), n=st.integers(1, 50), r=st.integers(1, 6), nt=threads, data=st.data())
@settings(deadline=None, max_examples=30)
def test_take_rows(T, n, r, nt, data):
    x = act(T, n)
    rows = np.array(data.draw(st.lists(st.integers(0, T - 1), min_size=r, max_size=r)), np.int32)
    sig = sig_for("take_rows", [f32("T", n), i32(r)])
    got = run(sig, [x, rows], T=T, nthreads=nt)
    np.testing.assert_array_equal(got, ops.take_rows_ref(x, rows))


# --- kv_write --------------------------------------------------------------------
@given(T=rows_t, D=st.integers(1, 40), extra=st.integers(0, 5), pos=st.integers(0, 40), nt=threads)
@settings(deadline=None, max_examples=30)
def test_kv_write(T, D, extra, pos, nt):
    rows = T or 1
    S = pos + rows + extra
    cache = rng.standard_normal((S, D)).astype(np.float32)
    x = act(T, D)
    sig = sig_for("kv_write", [f32(S, D), act_type(T, D), i32()])
    want = ops.kv_write_ref(cache.copy(), x, pos)
    got = run(sig, [cache, x, pos], pos=pos, T=rows, nthreads=nt, out=cache)
    assert got is cache
    np.testing.assert_array_equal(cache, want)


# --- attention -------------------------------------------------------------------
def attention_case(T, hd, kvh, group, past, window, nt, vw, extra=3, qscale=1.0):
    H = kvh * group
    rows = T or 1
    S = past + rows + extra
    q = act(T, H * hd, qscale)
    kc = rng.standard_normal((S, kvh * hd)).astype(np.float32)
    vc = rng.standard_normal((S, kvh * hd)).astype(np.float32)
    # rows nobody may read are NaN: positions after the chunk, and before the
    # first row's window
    kc[past + rows:] = np.nan
    vc[past + rows:] = np.nan
    if window:
        lo = max(0, past + 1 - window)
        kc[:lo] = np.nan
        vc[:lo] = np.nan
    attrs = dict(n_heads=H, n_kv_heads=kvh, head_dim=hd, scale=1.0 / math.sqrt(hd), window=window)
    sig = sig_for("attention", [act_type(T, H * hd), f32(S, kvh * hd), f32(S, kvh * hd), i32()], **attrs)
    got = run(sig, [q, kc, vc, past], pos=past, T=rows, nthreads=nt, vw=vw)
    want = ops.attention_ref(q, kc, vc, past, **attrs)
    close(got, want, rtol=1e-4, atol=2e-5)


@given(T=rows_t, hd=st.sampled_from([2, 6, 8, 16, 24, 64]), kvh=st.integers(1, 3), group=st.integers(1, 4),
       past=st.integers(0, 40), window=st.one_of(st.just(0), st.integers(1, 9)), nt=threads, vw=widths)
@settings(deadline=None, max_examples=100)
def test_attention(T, hd, kvh, group, past, window, nt, vw):
    attention_case(T, hd, kvh, group, past, window, nt, vw)


@pytest.mark.parametrize("hd,kvh,group,window", [(64, 2, 2, 0), (128, 1, 4, 0), (8, 4, 1, 0), (16, 2, 2, 1000)])
def test_attention_long_context(hd, kvh, group, window):
    attention_case(None, hd, kvh, group, 2900, window, 2, HOST_VW, extra=100)
    attention_case(3, hd, kvh, group, 1500, window, 3, HOST_VW)


def test_attention_peaked_scores():
    """Large scores (softmax close to one-hot) exercise the max subtraction and
    exp's range."""
    for vw in WIDTHS:
        attention_case(2, 16, 2, 2, 37, 0, 2, vw, qscale=30.0)


@pytest.mark.parametrize("hd,kvh,group,cache,cap", [
    (64, 2, 7, "f16", 0.0),     # Qwen2.5-0.5B's shape
    (64, 3, 3, "f32", 0.0),     # SmolLM2's
    (256, 1, 4, "f16", 0.0),    # Gemma 3's
    (48, 2, 2, "f32", 0.0),
    (24, 1, 2, "f16", 0.0),     # 8-key blocks on 16 lanes
    (64, 1, 2, "f32", 50.0),    # a soft cap
])
@pytest.mark.parametrize("vw", sorted({8, HOST_VW}))
def test_chunk_rows_have_the_decode_steps_bits(hd, kvh, group, cache, cap, vw):
    """A chunk's rows (taken ROWS at a time, keys transposed) and the decode
    steps of the same rows (one at a time, horizontal sums) give the same
    bits: the invariant prompt rows and decode steps keep model-wide."""
    H, T, past = kvh * group, 13, 37           # 13 rows: a unit of rows past the chunk's end
    S = past + T + 5
    dt = np.float16 if cache == "f16" else np.float32
    kc = rng.standard_normal((S, kvh * hd)).astype(dt)
    vc = rng.standard_normal((S, kvh * hd)).astype(dt)
    q = act(T, H * hd, 3.0)
    attrs = dict(n_heads=H, n_kv_heads=kvh, head_dim=hd, scale=1.0 / math.sqrt(hd), window=0, softcap=cap)
    ct = TensorType((S, kvh * hd), cache)
    sig = sig_for("attention", [f32("T", H * hd), ct, ct, i32()], **attrs)
    assert k_attention.rows_together(sig)
    chunk = run(sig, [q, kc, vc, past], pos=past, T=T, nthreads=2, vw=vw)
    one = sig_for("attention", [f32(H * hd), ct, ct, i32()], **attrs)
    for t in range(T):
        step = run(one, [q[t], kc, vc, past + t], pos=past + t, nthreads=2, vw=vw)
        np.testing.assert_array_equal(chunk[t], step, err_msg=f"row {t}")
        same_sig = run(sig, [q[t:t + 1], kc, vc, past + t], pos=past + t, T=1, nthreads=1, vw=vw)
        np.testing.assert_array_equal(chunk[t], same_sig[0], err_msg=f"row {t}, T=1")
    want = ops.attention_ref(q, kc.astype(np.float32), vc.astype(np.float32), past, **attrs)
    close(chunk, want, rtol=1e-4, atol=2e-5)


# --- emit helpers ------------------------------------------------------------------
def _helper_kernel(name: str, emit, n: int, vw: int) -> CompiledKernel:
    EMITTERS[name] = emit
    sig = KernelSig(name, (f32(n),), f32(n), ())
    return compiled(sig, vw)


def test_exp_poly_matches_numpy():
    n = 4096

    def emit(kb: KernelBuilder, sig):
        x, out = kb.in_f32(0), kb.out_f32()
        with kb.loop(0, n, step=8) as i:
            kb.vstore(exp_poly(kb, kb.vload(x, i, 8)), out, i)
        kb.store(exp_poly(kb, kb.load(x, 0)), out, n)  # the scalar form too, into out[n]

    k = _helper_kernel("_test_exp_poly", emit, n, HOST_VW)
    x = np.concatenate([np.linspace(-87.3, 88.0, n - 8), [0.0, -1e-3, 1e-3, 1.0, -1.0, 20.0, -20.0, 88.2]])
    x = x.astype(np.float32)
    out = np.zeros(n + 1, np.float32)
    k(out, [x])
    want = np.exp(x.astype(np.float64))
    np.testing.assert_allclose(out[:n], want, rtol=3e-7)
    np.testing.assert_allclose(out[n], want[0], rtol=3e-7)
    # below the clamp: tiny, not 0 / NaN; above it: finite
    x2 = np.array([-1000, -104, -90, -87.5, 88.5, 100, 1000, 0], np.float32)
    out2 = np.zeros(n + 1, np.float32)
    k(out2, [np.concatenate([x2, np.zeros(n - 8, np.float32)])])
    assert np.isfinite(out2[:8]).all() and (out2[:4] >= 0).all() and (out2[:4] < 2e-38).all()
    assert (out2[4:7] > 1e38).all()


@pytest.mark.parametrize("count,width", [(1, 1), (2, 2), (8, 1), (8, 2), (8, 8), (8, 16), (4, 16), (16, 4)])
def test_hsum_many(count, width):
    n = count * width

    def emit(kb: KernelBuilder, sig):
        x, out = kb.in_f32(0), kb.out_f32()
        s = hsum_many(kb, [kb.vload(x, i64(c * width), width) for c in range(count)])
        kb.vstore(s, out, 0)

    k = _helper_kernel(f"_test_hsum_many_{count}_{width}", emit, n, HOST_VW)
    x = rng.standard_normal(n).astype(np.float32)
    out = np.zeros(n, np.float32)
    k(out, [x])
    np.testing.assert_allclose(out[:count], x.reshape(count, width).sum(1), rtol=1e-5, atol=1e-6)


def test_scratch_rules():
    att = sig_for("attention", [f32("T", 64), f32(300, 32), f32(300, 32), i32()], n_heads=4, n_kv_heads=2,
                  head_dim=16, scale=0.25, window=0)
    assert k_attention.heads_per_unit(att) == 2            # the group of 2 heads: 2 units for a decode step
    # a score per position (and pad) and head of a unit, for ROWS rows, and a transposed key block
    pad = k_attention.SCORE_PAD
    assert k_attention.scratch_floats(att) == (300 + pad) * 2 * k_attention.ROWS + 16 * 16
    windowed = sig_for("attention", [f32("T", 64), f32(300, 32), f32(300, 32), i32()], n_heads=4,
                       n_kv_heads=2, head_dim=16, scale=0.25, window=8)
    assert k_attention.scratch_floats(windowed) == (300 + pad) * 2     # one row a unit
    rope = sig_for("rope", [f32("T", 64), i32()], head_dim=16, theta=1e4, style="neox")
    assert k_norm_rope.scratch_floats(rope) == 16
    assert k_norm_rope.scratch_floats(sig_for("take_last", [f32("T", 5)])) == 0
