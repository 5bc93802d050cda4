"""Kernels the newer family rows brought, against their numpy references:
layernorm (GPT-2, Phi-2, StarCoder2), learned position embeddings (GPT-2),
partial rotary RoPE (Phi-2), attention-logit soft-capping (Gemma 2; the
final-logit one is the elementwise ``softcap``, tested with the others).
Odd sizes, 1-3 threads, vector widths 4/8 and the host's."""
from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings, strategies as st

from compiler.codegen.harness import sig_for
from ir import ops
from ir.types import TensorType, f32, i32
from test_kernels_attention import act, act_type, close, rows_t, run, threads, weight, widths

rng = np.random.default_rng(5)


@given(T=rows_t, m=st.sampled_from([1, 3, 8, 24, 40, 100, 256]), layout=st.sampled_from(["F32", "F16"]),
       shift=st.sampled_from([0.0, 5.0]), nt=threads, vw=widths)
@settings(deadline=None, max_examples=60)
def test_layernorm(T, m, layout, shift, nt, vw):
    """Rows with a large common offset too: the mean must come out before the variance."""
    x = act(T, m, 3.0) + np.float32(shift)
    w, b = weight(rng.standard_normal(m), layout), weight(rng.standard_normal(m), layout)
    sig = sig_for("layernorm", [act_type(T, m), w.type, b.type], eps=1e-5)
    got = run(sig, [x, w, b], T=T or 1, nthreads=nt, vw=vw)
    close(got, ops.layernorm_ref(x, w, b, eps=1e-5), rtol=1e-5, atol=1e-5)


@given(T=st.integers(0, 6), d=st.sampled_from([1, 5, 16, 33, 64]), pos=st.integers(0, 20),
       batch=st.booleans(), layout=st.sampled_from(["F32", "F16"]), nt=threads, vw=widths)
@settings(deadline=None, max_examples=60)
def test_pos_embedding(T, d, pos, batch, layout, nt, vw):
    """Row pos + t of the table for token t (a decode step: T = 0, one row),
    or positions[t] for a batch of sequences."""
    rows = 32
    table = weight(rng.standard_normal((rows, d)), layout)
    n = max(T, 1)
    if batch and T:
        p = rng.integers(0, rows, size=T).astype(np.int32)
        ins, args = [table.type, TensorType(("T",), "i32"), TensorType(("T",), "i32")], [table, p, np.zeros(T, np.int32)]
    else:
        p = min(pos, rows - n)
        tok = TensorType(() if T == 0 else ("T",), "i32")
        ins, args = [table.type, i32(), tok], [table, p, np.zeros(() if T == 0 else T, np.int32)]
    sig = sig_for("pos_embedding", ins)
    got = run(sig, args, pos=int(p) if np.ndim(p) == 0 else 0, T=n, nthreads=nt, vw=vw)
    want = ops.pos_embedding_ref(*args)
    np.testing.assert_array_equal(got, want)


@given(T=rows_t, hd=st.sampled_from([8, 16, 64, 80]), frac=st.sampled_from([0.25, 0.5, 0.75]),
       heads=st.integers(1, 3), pos=st.integers(0, 3000), style=st.sampled_from(["interleaved", "neox"]),
       nt=threads, vw=widths)
@settings(deadline=None, max_examples=60)
def test_partial_rotary(T, hd, frac, heads, pos, style, nt, vw):
    """Only each head's first ``dims`` values rotate (with a head of that
    size's frequencies); the others are copied unchanged."""
    dims = max(2, int(hd * frac) // 2 * 2)
    n = hd * heads
    x = act(T, n)
    attrs = dict(head_dim=hd, theta=10000.0, style=style, dims=dims)
    sig = sig_for("rope", [act_type(T, n), i32()], **attrs)
    got = run(sig, [x, pos], pos=pos, T=T or 1, nthreads=nt, vw=vw)
    want = ops.rope_ref(x, pos, **attrs)
    close(got, want, rtol=0, atol=1e-5)
    # the reference itself: the tail is x, the rotated part is a full rope of a dims-sized head
    xr, wr = x.reshape(-1, heads, hd), want.reshape(-1, heads, hd)
    np.testing.assert_array_equal(wr[..., dims:], xr[..., dims:])
    full = ops.rope_ref(np.ascontiguousarray(xr[..., :dims]).reshape(-1, heads * dims), pos, head_dim=dims,
                        theta=10000.0, style=style)
    np.testing.assert_array_equal(wr[..., :dims].reshape(full.shape), full)


@given(T=rows_t, hd=st.sampled_from([8, 16, 64]), group=st.integers(1, 3), past=st.integers(0, 40),
       cap=st.sampled_from([5.0, 50.0]), window=st.sampled_from([0, 7]), nt=threads, vw=widths)
@settings(deadline=None, max_examples=60)
def test_attention_softcap(T, hd, group, past, cap, window, nt, vw):
    """Scores through cap * tanh(s / cap) before the softmax; large queries so
    that the cap bites."""
    kvh, rows = 2, T or 1
    H, S = kvh * group, past + rows + 2
    q = act(T, H * hd, 6.0)
    kc = rng.standard_normal((S, kvh * hd)).astype(np.float32)
    vc = rng.standard_normal((S, kvh * hd)).astype(np.float32)
    attrs = dict(n_heads=H, n_kv_heads=kvh, head_dim=hd, scale=1.0 / math.sqrt(hd), window=window, softcap=cap)
    sig = sig_for("attention", [act_type(T, H * hd), f32(S, kvh * hd), f32(S, kvh * hd), i32()], **attrs)
    got = run(sig, [q, kc, vc, past], pos=past, T=rows, nthreads=nt, vw=vw)
    want = ops.attention_ref(q, kc, vc, past, **attrs)
    close(got, want, rtol=1e-4, atol=2e-5)
    if cap == 5.0 and hd == 64 and past >= 3 and not window:  # several keys: the cap changes the answer
        plain = ops.attention_ref(q, kc, vc, past, **{**attrs, "softcap": 0.0})
        assert np.abs(plain - want).max() > 1e-3
