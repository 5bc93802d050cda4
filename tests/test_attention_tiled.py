"""The tiled prefill attention (``k_attention_tiled``: AMX bf16 tiles, a
call of MIN_ROWS rows or more on an f16 cache) against ``attention_ref``,
and the cases that keep the per-row kernel (few rows, an f32 cache, a
window, a ring, a q8 cache, no AMX).

Tolerance: every operand of the two products is split into two bf16 halves
(hi = bf16(x), lo = bf16(x - hi): an f16 key or value exactly, a query or a
weight to ~2^-17) and the three larger of the four cross products are
summed in f32, so outputs are f32's up to rounding order and the dropped
lo.lo product: the bound is 2e-5 absolute (outputs |out| < ~3), against
~1e-3 with plain bf16 operands (2^-9 each). That the tiles ran is shown by
bits that differ from the per-row kernel's."""
from __future__ import annotations

import math

import numpy as np
import pytest

from compiler.codegen import k_attention, k_attention_tiled
from compiler.codegen.harness import CompiledKernel, sig_for
from compiler.codegen.target import host_target, without_amx
from ir import ops
from ir.types import TensorType, i32, kv_cache_type

HOST = host_target()
HAS_TILES = HOST.amx and HOST.has("amx-bf16")
needs_tiles = pytest.mark.skipif(not HAS_TILES, reason="no AMX bf16 on this host (or the tile state was refused): "
                                                       "the per-row kernel runs, tested below and in test_kernels_attention")
SENTINEL = np.float32(12345.0)
_KERNELS: dict = {}


def bf16(x: np.ndarray) -> np.ndarray:
    """x rounded to bfloat16 (nearest even), as float32."""
    b = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16 << 16).astype(np.uint32)
    return b.view(np.float32)


def case(T, past, H, kvh, hd, kind="f16", tiled=1, nt=2, seed=0, **extra):
    """(got, want, q, kc, vc, attrs): the kernel on T rows at position
    ``past`` (cache rows past the chunk are NaN: nobody may read them)."""
    rng = np.random.default_rng(seed)
    S = past + T + 5
    q = rng.standard_normal((T, H * hd), dtype=np.float32)
    dt = np.float16 if kind == "f16" else np.float32
    kc = rng.standard_normal((S, kvh * hd), dtype=np.float32).astype(dt)
    vc = rng.standard_normal((S, kvh * hd), dtype=np.float32).astype(dt)
    kc[past + T:] = np.nan
    vc[past + T:] = np.nan
    attrs = dict(n_heads=H, n_kv_heads=kvh, head_dim=hd, scale=1.0 / math.sqrt(hd), window=0, **extra)
    ct = kv_cache_type(kind, S, kvh * hd) if kind != "f32" else TensorType((S, kvh * hd), "f32")
    sig = sig_for("attention", [TensorType(("T", H * hd), "f32"), ct, ct, i32()], tiled=tiled, **attrs)
    key = sig
    if key not in _KERNELS:
        _KERNELS[key] = CompiledKernel(sig)
    k = _KERNELS[key]
    need = k_attention.scratch_floats(sig)
    scratch = np.full(need + 64, SENTINEL, np.float32)
    out = np.full((T, H * hd), np.nan, np.float32)
    for tid in range(nt):
        k(out, [q, kc, vc, past], pos=past, T=T, tid=tid, nthreads=nt, scratch=scratch)
    assert (scratch[need:] == SENTINEL).all(), "kernel wrote past its scratch_floats"
    want = ops.attention_ref(q, kc, vc, past, **attrs)
    return out, want, q, kc, vc, attrs


SHAPES = [   # (T, past, heads, kv heads, head_dim)
    (16, 0, 14, 2, 64),      # one tile, Qwen2.5-0.5B's heads
    (37, 100, 14, 2, 64),    # a partial last tile, a chunk after a past
    (128, 300, 14, 2, 64),   # a prompt chunk
    (40, 50, 8, 4, 256),     # Gemma's head_dim
    (33, 7, 4, 1, 128),
    (20, 0, 2, 2, 32),       # no grouping
]


@needs_tiles
@pytest.mark.parametrize("T,past,H,kvh,hd", SHAPES)
def test_tiled_matches_reference(T, past, H, kvh, hd):
    got, want, q, kc, vc, attrs = case(T, past, H, kvh, hd, "f16")
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() < 2e-5
    per_row = case(T, past, H, kvh, hd, "f16", tiled=0)[0]
    assert not np.array_equal(got, per_row), "the tiled kernel did not run (the per-row kernel's bits)"


@needs_tiles
@pytest.mark.parametrize("T,past,H,kvh,hd", SHAPES[:2])
def test_an_f32_cache_keeps_the_per_row_kernel(T, past, H, kvh, hd):
    """An f32 cache is asked for to reproduce float references (run.c): f32 arithmetic."""
    got, want, *_ = case(T, past, H, kvh, hd, "f32")
    assert np.abs(got - want).max() < 1e-5


@needs_tiles
def test_tiled_softcap():
    got, want, *_ = case(24, 40, 4, 2, 64, softcap=5.0)
    assert np.abs(got - want).max() < 2e-5


@needs_tiles
def test_tiled_peaked_scores():
    """Large scores (one key dominating each row): the max subtraction keeps exp finite."""
    rng = np.random.default_rng(3)
    T, past, H, kvh, hd = 32, 64, 4, 2, 64
    S = past + T
    q = (rng.standard_normal((T, H * hd)) * 8).astype(np.float32)
    kc = (rng.standard_normal((S, kvh * hd)) * 8).astype(np.float16)
    vc = rng.standard_normal((S, kvh * hd)).astype(np.float16)
    attrs = dict(n_heads=H, n_kv_heads=kvh, head_dim=hd, scale=1.0 / math.sqrt(hd), window=0)
    ct = kv_cache_type("f16", S, kvh * hd)
    sig = sig_for("attention", [TensorType(("T", H * hd), "f32"), ct, ct, i32()], tiled=1, **attrs)
    k = CompiledKernel(sig)
    out = np.full((T, H * hd), np.nan, np.float32)
    k(out, [q, kc, vc, past], pos=past, T=T, tid=0, nthreads=1,
      scratch=np.zeros(k_attention.scratch_floats(sig) + 64, np.float32))
    want = ops.attention_ref(q, kc, vc, past, **attrs)
    assert np.isfinite(out).all()
    # scores of ~64 (sd): a bf16 rounding of q or k would move one by ~0.25 and shift the weights
    # of near ties by ~25% (outputs off by up to ~0.5). Split in halves, what is left is the dropped
    # lo.lo product, ~2^-18 |q||k| (|q|, |k| ~ 64 here: ~2e-3 on a scaled score), so weights move
    # by ~0.2% and outputs by ~1e-3 of the values at most
    assert np.abs(out - want).max() < 1e-3 * np.abs(vc.astype(np.float32)).max()


@needs_tiles
@pytest.mark.parametrize("T,past", [(16, 0), (53, 200)])
def test_tiled_independent_of_threads(T, past):
    one = case(T, past, 14, 2, 64, nt=1)[0]
    for nt in (2, 3, 5):
        np.testing.assert_array_equal(case(T, past, 14, 2, 64, nt=nt)[0], one)


@pytest.mark.parametrize("T", [1, 4, 15])
def test_few_rows_keep_the_per_row_kernel(T):
    """Below MIN_ROWS (decode steps, speculative checks) the per-row f32 kernel runs: its
    error is float rounding, not bf16's."""
    got, want, *_ = case(T, 70, 14, 2, 64)
    assert np.abs(got - want).max() < 1e-5


@pytest.mark.parametrize("extra", [dict(tiled=0), dict(window=9)])
def test_other_cases_keep_the_per_row_kernel(extra):
    """tiled=0, or a window (not tiled: see ``supported``): the per-row kernel's accuracy."""
    tiled = extra.pop("tiled", 1)
    args = dict(extra)
    window = args.pop("window", 0)
    rng = np.random.default_rng(5)
    T, past, H, kvh, hd = 32, 40, 4, 2, 64
    S = past + T
    q = rng.standard_normal((T, H * hd), dtype=np.float32)
    kc = rng.standard_normal((S, kvh * hd), dtype=np.float32).astype(np.float16)
    vc = rng.standard_normal((S, kvh * hd), dtype=np.float32).astype(np.float16)
    attrs = dict(n_heads=H, n_kv_heads=kvh, head_dim=hd, scale=1.0 / math.sqrt(hd), window=window)
    ct = kv_cache_type("f16", S, kvh * hd)
    sig = sig_for("attention", [TensorType(("T", H * hd), "f32"), ct, ct, i32()], tiled=tiled, **attrs)
    k = CompiledKernel(sig)
    out = np.full((T, H * hd), np.nan, np.float32)
    k(out, [q, kc, vc, past], pos=past, T=T, tid=0, nthreads=1,
      scratch=np.zeros(k_attention.scratch_floats(sig) + 64, np.float32))
    assert np.abs(out - ops.attention_ref(q, kc, vc, past, **attrs)).max() < 1e-5


def _sig(kind="f16", hd=64, **attrs):
    S = 256
    ct = kv_cache_type(kind, S, 2 * hd)
    a = dict(n_heads=4, n_kv_heads=2, head_dim=hd, scale=0.125, window=0)
    a.update(attrs)
    return sig_for("attention", [TensorType(("T", 4 * hd), "f32"), ct, ct, i32()], **a)


def test_supported_shapes():
    assert k_attention_tiled.supported(_sig(), "f16")
    assert not k_attention_tiled.supported(_sig(window=16, ring=256), "f16")    # a ring
    assert not k_attention_tiled.supported(_sig(window=16), "f16")             # a window
    assert not k_attention_tiled.supported(_sig(hd=48), "f16")                 # head_dim not a multiple of 32
    assert not k_attention_tiled.supported(_sig("q8"), "q8")
    ct = kv_cache_type("f16", 256, 128)
    decode = sig_for("attention", [TensorType((256,), "f32"), ct, ct, i32()], n_heads=4, n_kv_heads=2,
                     head_dim=64, scale=0.125, window=0)
    assert not k_attention_tiled.supported(decode, "f16")                      # one row


def test_no_amx_means_per_row_kernel():
    """A target without AMX never takes the tiles, whatever the attribute says; the
    kernel compiled for it (which this host runs) has the per-row kernel's accuracy."""
    from compiler.codegen.emit import KernelBuilder
    import llvmlite.ir as ir

    t = without_amx(HOST)
    kb = KernelBuilder(ir.Module(), "k", t.vector_width, target=t)
    assert not k_attention_tiled.usable(kb, _sig(tiled=1), "f16")
    rng = np.random.default_rng(2)
    T, past = 32, 20
    S = 256
    q = rng.standard_normal((T, 4 * 64), dtype=np.float32)
    kc = rng.standard_normal((S, 128), dtype=np.float32).astype(np.float16)
    vc = rng.standard_normal((S, 128), dtype=np.float32).astype(np.float16)
    sig = _sig(tiled=1)
    k = CompiledKernel(sig, target=t)
    out = np.full((T, 4 * 64), np.nan, np.float32)
    k(out, [q, kc, vc, past], pos=past, T=T, tid=0, nthreads=1,
      scratch=np.zeros(k_attention.scratch_floats(sig) + 64, np.float32))
    want = ops.attention_ref(q, kc, vc, past, n_heads=4, n_kv_heads=2, head_dim=64, scale=0.125, window=0)
    assert np.abs(out - want).max() < 1e-5


def test_scratch_grows_only_when_tiled():
    """The bf16 keys and values take scratch (per thread) only where the tiles may run."""
    on, off = k_attention.scratch_floats(_sig(tiled=1)), k_attention.scratch_floats(_sig(tiled=0))
    # the rows path's scores (ROWS rows of a unit's heads, each 256 positions and a pad) and key block
    assert off == (256 + k_attention.SCORE_PAD) * k_attention.heads_per_unit(_sig(tiled=0)) * k_attention.ROWS + 64 * 16
    assert on * 4 >= k_attention_tiled.scratch_bytes(_sig(tiled=1)) > off * 4
    if k_attention_tiled.DEFAULT == 0:
        assert k_attention.scratch_floats(_sig()) == off


def test_a_models_long_prompts_take_the_tiles(monkeypatch):
    """Through ``runtime.load`` on SmolLM2, a prompt longer than
    ``FROM_POSITION``: its rows before that position have the bits they have
    with ``LMC_ATTN_TILED=0`` (the decode step's); the rows after it attend on
    the tiles, so their logits move by attention rounding (amplified by the
    int8 activations that follow), with the same predictions except where the
    top two are close. A row's bits do not depend on how the prompt was cut
    into calls. The prefill graphs carry the attributes; the verify graph,
    whose rows must have the decode step's bits, does not."""
    if not (HOST.amx and HOST.has("amx-bf16")):
        pytest.skip("no AMX bf16 on this host: the switch changes nothing")
    import runtime
    from compiler.driver import FROM_POSITION
    from compiler.native import NativeOptions, plan_native
    from frontends.loader import load_model
    from shared_data import SMOLLM2, instruct_models

    path = instruct_models()[SMOLLM2]
    prompt = ("The tiled kernel multiplies sixteen query rows by sixteen keys at a time, so a long "
              "prompt reads each key once per tile instead of once per row. ") * 22
    ctx = 2 * FROM_POSITION

    def load(tiled: bool):
        monkeypatch.setenv("LMC_ATTN_TILED", "1" if tiled else "0")
        return runtime.load(path, ctx=ctx)

    m = load(True)
    ids = m.encode(prompt, bos=True)
    assert FROM_POSITION + 2 * k_attention_tiled.MIN_ROWS <= len(ids) < ctx
    tiled = np.array(m.executor.prefill(ids, 0, all_logits=True))
    m.executor.reset()
    cut = 300   # another chunking: the rows from FROM_POSITION on have the same bits
    again = np.concatenate([np.array(m.executor.prefill(ids[:cut], 0, all_logits=True)),
                            np.array(m.executor.prefill(ids[cut:], cut, all_logits=True))])
    np.testing.assert_array_equal(again, tiled)
    del m
    m = load(False)
    base = np.array(m.executor.prefill(ids, 0, all_logits=True))
    del m

    F = FROM_POSITION
    np.testing.assert_array_equal(tiled[:F], base[:F])
    diff = np.abs(tiled[F:] - base[F:]).max()
    assert 0 < diff < 3.0, diff     # SmolLM2 on a short prompt, every row tiled: 1.32 (Emerald Rapids)
    same = np.argmax(tiled[F:], -1) == np.argmax(base[F:], -1)
    assert same.mean() >= 0.9
    top2 = np.sort(base[F:], -1)[:, -2:]
    assert ((top2[:, 1] - top2[:, 0])[~same] < 1.0).all()

    monkeypatch.delenv("LMC_ATTN_TILED")
    plan = plan_native(load_model(path), NativeOptions(ctx=256, verify=True))
    tiled_nodes = {name: [(n.attrs.get("tiled"), n.attrs.get("tiled_from")) for n in g.nodes if n.op == "attention"]
                   for name, g in plan.graphs.items()}
    assert set(tiled_nodes["prefill"]) == {(1, F)} and set(tiled_nodes["verify"]) == {(None, None)}, tiled_nodes


def run_rows(sig, q, kc, vc, pos, nt=2):
    """The kernel of ``sig`` on the query rows q at position pos (every thread's share)."""
    key = sig
    if key not in _KERNELS:
        _KERNELS[key] = CompiledKernel(sig)
    k = _KERNELS[key]
    out = np.full(q.shape, np.nan, np.float32)
    scratch = np.full(k_attention.scratch_floats(sig) + 64, SENTINEL, np.float32)
    for tid in range(nt):
        k(out, [q, kc, vc, pos], pos=pos, T=len(q), tid=tid, nthreads=nt, scratch=scratch)
    assert (scratch[-64:] == SENTINEL).all(), "kernel wrote past its scratch_floats"
    return out


@needs_tiles
@pytest.mark.parametrize("start", [0, 1, 5, 16, 31, 47])
def test_tiled_from_a_position(start):
    """A model's prompt graphs (``tiled_from``, ``compiler.driver.FROM_POSITION``):
    a call's rows before the position have the per-row kernel's bits, a decode
    step's; the rows from it on have the tiles' bits, however few they are and
    however the prompt was cut into calls, so a row's bits depend on its
    position alone (what makes a warm start, a cold one and any chunk size
    agree)."""
    rng = np.random.default_rng(11)
    H, kvh, hd, past, T = 14, 2, 64, 40, 48
    S = past + T + 5
    F = past + start
    q = rng.standard_normal((T, H * hd), dtype=np.float32)
    kc = rng.standard_normal((S, kvh * hd), dtype=np.float32).astype(np.float16)
    vc = rng.standard_normal((S, kvh * hd), dtype=np.float32).astype(np.float16)
    kc[past + T:] = np.nan
    vc[past + T:] = np.nan
    attrs = dict(n_heads=H, n_kv_heads=kvh, head_dim=hd, scale=1.0 / math.sqrt(hd), window=0)
    ct = kv_cache_type("f16", S, kvh * hd)
    shape = [TensorType(("T", H * hd), "f32"), ct, ct, i32()]
    split = sig_for("attention", shape, tiled=1, tiled_from=F, **attrs)
    rows = sig_for("attention", shape, tiled=0, **attrs)
    tiles = sig_for("attention", shape, tiled=1, **attrs)

    got = run_rows(split, q, kc, vc, past)
    per_row = run_rows(rows, q, kc, vc, past)
    np.testing.assert_array_equal(got[:start], per_row[:start])
    if start < T:
        assert np.abs(got[start:] - per_row[start:]).max() < 2e-5
        assert not np.array_equal(got[start:], per_row[start:]), "the tiles did not run"
    # the rows from F on: the same bits as a call of them alone (tiles on every row, or few rows
    # on the split kernel), as one call of rows 3.. and as calls of 7 rows
    if T - start >= k_attention_tiled.MIN_ROWS:
        np.testing.assert_array_equal(got[start:], run_rows(tiles, q[start:], kc, vc, F))
    np.testing.assert_array_equal(got[3:], run_rows(split, q[3:], kc, vc, past + 3))
    cut = np.concatenate([run_rows(split, q[i:i + 7], kc, vc, past + i) for i in range(0, T, 7)])
    np.testing.assert_array_equal(cut, got)
    want = ops.attention_ref(q, kc, vc, past, **attrs)
    assert np.abs(got - want).max() < 2e-5
