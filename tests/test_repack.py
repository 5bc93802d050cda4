"""The ``repack`` pass and repacked weights at run time, on whole models.

The pass leaves the interpreter's numbers unchanged. Natively, with every
matmul on repacked weights, a token's logits are the same bits whatever
computes them: a decode step, a row of a prompt chunk, a row of a served
batch (so no separate ``batch_decode`` entry is built). The repacked bytes
are built while compiling, cached, and mapped at load; a missing or damaged
cache entry is rebuilt at load; streamed weights are repacked too and read
from the repacked bytes' file, with the resident bits."""
from __future__ import annotations

import os

import numpy as np
import pytest

from compiler import repack_cache
from compiler.codegen.target import vnni_width
from compiler.codegen.target import host_target
from compiler.driver import BatchOptions, CompileOptions, build_graphs, load_model, repack_width
from compiler.native import NativeOptions, compile_native, plan_native
from frontends.arch import ModelConfig, expected_shapes
from frontends.gguf_writer import write_gguf
from ir.interp import new_state, run
from llamacpp_oracle import printable_vocab, random_tensor
from runtime.native import NativeExecutor

CTX = 48
VOCAB = 320
PASSES = ("fuse_dequant", "fuse_elementwise", "int_dot")
#: synthetic models whose every matmul can be repacked: (config, qtype asked for)
MODELS = {
    "q8_0": (dict(arch="qwen2", dim=256, hidden_dim=512, n_layers=2, n_heads=4, n_kv_heads=2,
                  tied_output=False), "Q8_0"),
    "q4_0": (dict(arch="llama", dim=256, hidden_dim=512, n_layers=2, n_heads=4, n_kv_heads=2,
                  tied_output=True), "Q4_0"),
    # 320-wide rows take Q5_0 where Q4_K is asked for (llama.cpp's quantizer does so), ffn_down Q4_K
    "q5_0": (dict(arch="qwen2", dim=320, hidden_dim=512, n_layers=2, n_heads=5, n_kv_heads=1,
                  tied_output=False), "Q4_K"),
    "q4_k": (dict(arch="gemma3", dim=256, hidden_dim=512, n_layers=2, n_heads=4, n_kv_heads=1,
                  tied_output=True, rope_theta=1e6, extra={"rope_local_theta": 10000.0}), "Q4_K"),
}


def width_or_skip() -> int:
    w = repack_width()
    if w is None:
        pytest.skip("no VNNI on this host (or LMC_REPACK=0): nothing is repacked")
    return w


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for name, (cfg, qtype) in MODELS.items():
        c = ModelConfig(**cfg, vocab_size=VOCAB, seq_len=CTX)
        p = tmp_path_factory.mktemp("repack") / f"{name}.gguf"
        write_gguf(p, c, random_tensor(expected_shapes(c), 5), qtype, vocab=printable_vocab(VOCAB))
        out[name] = load_model(str(p))
    return out


def prefill_logits(graphs, ids):
    g = graphs["prefill_all"]
    return run(g, {"tokens": np.asarray(ids, np.int32), "pos": np.int32(0)}, new_state(g))["logits"]


@pytest.mark.parametrize("width", [8, 16])
@pytest.mark.parametrize("name", list(MODELS))
def test_repack_keeps_the_interpreters_numbers(models, name, width):
    """Every integer-path matmul reads a repacked weight (a tied embedding's
    lookup keeps the file's), and the interpreter's logits are bit for bit
    those of the graph before the pass."""
    m = models[name]
    plain = build_graphs(m, CompileOptions(ctx=CTX, passes=PASSES))
    packed = build_graphs(m, CompileOptions(ctx=CTX, passes=PASSES + ("repack",), repack_width=width))
    g = packed["decode"]
    widths = {n.inputs[1].type.repack for n in g.nodes if n.op == "qmatmul"}
    assert widths == {width}
    assert not next(n for n in g.nodes if n.op == "embedding").inputs[0].type.repack
    ids = [1, 7, 42, 9, 300]
    np.testing.assert_array_equal(prefill_logits(packed, ids), prefill_logits(plain, ids))


def _native(m, **kw) -> NativeExecutor:
    art = compile_native(m, NativeOptions(ctx=CTX, prefill_chunk=16, passes=PASSES + ("repack",), **kw)).artifact
    return NativeExecutor(art, m.path, threads=2)


@pytest.mark.parametrize("name", list(MODELS))
def test_one_arithmetic_for_every_row_count(models, name):
    """Natively: decode steps, the rows of a prefill (chunks of 16), the
    decode rows and prompt rows of a paged batch: every token's logits the
    same bits."""
    width_or_skip()
    m = models[name]
    rng = np.random.default_rng(3)
    ids = [1] + [int(t) for t in rng.integers(3, VOCAB, 36)]
    single = _native(m)
    rows = np.array(single.prefill(ids, 0, all_logits=True))     # (the executor's output buffer: copies)
    single.reset()
    steps = np.stack([np.array(single.decode(t, p)) for p, t in enumerate(ids)])
    np.testing.assert_array_equal(rows, steps)
    assert np.abs(rows).max() > 0

    bo = BatchOptions(block_size=4, n_blocks=40, max_batch=4)
    batch = _native(m, batch=bo)
    assert "batch_decode" not in batch.entries      # decode rows run through ``batch``: it gives their bits
    table = list(range(10))
    got = np.array(batch.batch(ids[:16], list(range(16)), [table] * 16))
    np.testing.assert_array_equal(got, rows[:16])
    last = batch.batch(ids[16:20], list(range(16, 20)), [table] * 4, last_only=True)
    np.testing.assert_array_equal(np.reshape(last, -1), rows[19])
    for p in range(20, 24):
        np.testing.assert_array_equal(batch.batch([ids[p]], [p], [table], decode=True)[0], rows[p])


def test_repacked_bytes_are_cached_at_compile_and_mapped(models, tmp_path, monkeypatch):
    """Compiling writes the cache entry; loading maps it; a truncated or
    overwritten entry is rebuilt at load (same logits); with
    LMC_REPACK_CACHE=0 nothing is written and the weights are repacked in place."""
    width_or_skip()
    monkeypatch.setenv("LMC_CACHE_DIR", str(tmp_path / "cache"))
    m = models["q4_k"]
    art = compile_native(m, NativeOptions(ctx=CTX, passes=PASSES + ("repack",))).artifact
    regions = art.manifest["image"]["regions"]
    key = repack_cache.cache_key(art.manifest["model"], regions)
    lo, hi = repack_cache.span(repack_cache.repack_regions(regions))
    path = repack_cache.lookup(key, hi - lo)
    assert path is not None
    ids = [1, 5, 77, 260, 9]
    ex = NativeExecutor(art, m.path, threads=2)
    assert ex._map.repacked == "mapped"
    want = np.array(ex.prefill(ids, 0, all_logits=True))
    with open(path, "r+b") as f:
        f.truncate(1000)
    ex = NativeExecutor(art, m.path, threads=2)
    assert ex._map.repacked == "built"
    np.testing.assert_array_equal(ex.prefill(ids, 0, all_logits=True), want)
    assert os.path.getsize(path) == hi - lo       # stored again, whole
    ex = NativeExecutor(art, m.path, threads=2)
    assert ex._map.repacked == "mapped"
    np.testing.assert_array_equal(ex.prefill(ids, 0, all_logits=True), want)
    with open(path, "r+b") as f:          # overwritten in place, same size: the sampled digest differs
        f.seek(100)
        f.write(b"\xff" * 64)
    ex = NativeExecutor(art, m.path, threads=2)
    assert ex._map.repacked == "built"
    np.testing.assert_array_equal(ex.prefill(ids, 0, all_logits=True), want)
    assert repack_cache.lookup(key, hi - lo) == path   # stored and sealed again

    monkeypatch.setenv("LMC_REPACK_CACHE", "0")
    os.remove(path)
    ex = NativeExecutor(art, m.path, threads=2)
    assert ex._map.repacked == "built" and not os.path.exists(path)
    np.testing.assert_array_equal(ex.prefill(ids, 0, all_logits=True), want)


@pytest.mark.parametrize("cache", ["1", "0"])
def test_streamed_weights_are_repacked_and_give_the_resident_bits(models, cache, monkeypatch):
    """A budget changes where a weight lives, not the arithmetic: streamed
    weights are repacked too, read from the repacked weights' file (the
    cache's entry; a temporary file with the cache off), and every prompt
    row and decode step has the resident model's bits."""
    from passes.stream_schedule import FROM_REPACKED

    w = width_or_skip()
    monkeypatch.setenv("LMC_REPACK_CACHE", cache)
    m = models["q8_0"]
    planned = plan_native(m, NativeOptions(ctx=CTX, stream="all", head_rows=64, passes=PASSES + ("repack",)))
    types = {n.inputs[1].type.stored for g in planned.graphs.values() for n in g.nodes
             if n.op in ("qmatmul", "qmatmul_rows")}
    assert types == {f"Q8_0x{w}"}
    assert planned.schedule.repack_lo is not None
    assert all(r[5] == FROM_REPACKED for s in planned.schedule.segments for r in s.ranges if r[3] == 0 and r[1] > 4096)
    rng = np.random.default_rng(4)
    ids = [1] + [int(t) for t in rng.integers(3, VOCAB, 30)]
    resident = _native(m)
    want = np.array(resident.prefill(ids, 0, all_logits=True))
    streamed = _native(m, stream="all", head_rows=64)
    assert streamed._map.repacked == ("mapped" if cache == "1" else "file")
    np.testing.assert_array_equal(np.array(streamed.prefill(ids, 0, all_logits=True)), want)
    streamed.reset()
    steps = np.stack([np.array(streamed.decode(t, p)) for p, t in enumerate(ids)])
    np.testing.assert_array_equal(steps, want)
    assert streamed.stream_stats()["read_bytes"] > 0


def test_repack_width_follows_the_host_and_the_switch(monkeypatch):
    assert repack_width(16) == vnni_width(16) and repack_width(4) is None
    assert repack_width() == vnni_width(host_target().vector_width)
    monkeypatch.setenv("LMC_REPACK", "0")
    assert repack_width() is None
