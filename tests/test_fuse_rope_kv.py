"""The keys' RoPE and their KV-cache write as one op (``rope_kv_write``,
``rope_kv_write_paged``: passes/fuse_elementwise).

The rewrite on the frontend's graphs (decode, prefill, paged batch; every
KV storage type), the interpreter's numbers with and without it (logits and
caches to the last bit), the fused kernel against the native rope then
kv_write kernels (bit for bit) and the numpy reference (odd head counts and
sizes, both styles, scaling, partial rotary, several rows, the paged pool,
1-3 threads), and compiled models' logits and caches with the fusion on and
off.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from compiler.codegen.harness import sig_for
from compiler.driver import BatchOptions, CompileOptions, build_graphs, load_model
from compiler.native import NativeOptions, compile_native
from compiler.pipeline import DEFAULT_PIPELINE, default_pipeline, run_pipeline
from frontends.arch import ModelConfig, build_graph, expected_shapes
from frontends.gguf_writer import write_gguf
from ir import kv_codec, ops
from ir.interp import state_array
from ir.types import f32, i32, kv_cache_type
from llamacpp_oracle import printable_vocab, random_tensor
from runtime.cli import DEFAULT_MODEL, DEFAULT_TOKENIZER
from runtime.executor import InterpExecutor
from runtime.native import NativeExecutor
from test_kernels_attention import WIDTHS, act, act_type, run, weight
from test_kernels_paged import lens_ks, make_batch, pool

CTX = 32
BATCH = BatchOptions(block_size=4, n_blocks=24, max_batch=4)
#: the default pipeline with only the glu half of fuse_elementwise: the fusion "off"
UNFUSED = tuple("fuse_glu" if p == "fuse_elementwise" else p for p in DEFAULT_PIPELINE)
rng = np.random.default_rng(5)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """stories260K (head_dim 8: f32 and f16 caches) and a small Qwen2
    (neox rope, head_dim 32: a q8 cache too)."""
    cfg = ModelConfig(arch="qwen2", dim=128, hidden_dim=256, n_layers=2, n_heads=4, n_kv_heads=2,
                      tied_output=False, vocab_size=300, seq_len=CTX)
    p = tmp_path_factory.mktemp("ropekv") / "qwen2.gguf"
    write_gguf(p, cfg, random_tensor(expected_shapes(cfg), 3), "F32", vocab=printable_vocab(300))
    return {"stories": load_model(str(DEFAULT_MODEL), str(DEFAULT_TOKENIZER)), "qwen2": load_model(str(p), None)}


def count(graph, op: str) -> int:
    return sum(n.op == op for n in graph.nodes)


# --- the rewrite ------------------------------------------------------------------------
@pytest.mark.parametrize("name,kv", [("stories", "f32"), ("stories", "f16"), ("qwen2", "q8")])
@pytest.mark.parametrize("batch", [None, BATCH])
def test_every_layer_writes_rotated_keys_in_one_op(models, name, kv, batch):
    m = models[name]
    n = m.config.n_layers
    suffix = "_paged" if batch else ""
    for gname, g in build_graphs(m, CompileOptions(ctx=CTX, kv_type=kv, batch=batch, passes=DEFAULT_PIPELINE)).items():
        assert count(g, "rope_kv_write" + suffix) == n, gname
        assert count(g, "rope") == n and count(g, "kv_write" + suffix) == n, gname   # the queries; the values
        for node in g.nodes:
            if node.op == "rope_kv_write" + suffix:
                assert node.inputs[0].kind == "state" and node.inputs[0].name.startswith("k_cache.")


def test_rotated_keys_something_else_reads_stay_written(models):
    m = models["stories"]
    g = build_graph(m.config, m.weights, "decode")
    rope = [nd for nd in g.nodes if nd.op == "rope"][1]   # layer 0's keys
    g.outputs.append(rope.output)
    g = run_pipeline(g, ["fuse_rope_kv"])
    assert count(g, "rope_kv_write") == m.config.n_layers - 1 and count(g, "rope") == m.config.n_layers + 1


def test_the_touched_state_is_still_the_cache(models):
    """passes/barriers sees the fused op write the key cache (operand 0)."""
    from passes.dependency_groups import touched_states

    m = models["stories"]
    g = run_pipeline(build_graph(m.config, m.weights, "decode"), ["fuse_rope_kv"])
    for node, states in zip(g.nodes, touched_states(g)):
        if node.op == "rope_kv_write":
            assert states == {node.inputs[0].name}


# --- the interpreter: the same numbers ---------------------------------------------------
def _interp(m, kv: str, passes, batch=None) -> InterpExecutor:
    return InterpExecutor(build_graphs(m, CompileOptions(ctx=CTX, kv_type=kv, batch=batch, passes=passes)))


def _same_states(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k].view(np.uint8), b[k].view(np.uint8), err_msg=k)


@pytest.mark.parametrize("name,kv", [("stories", "f32"), ("stories", "f16"), ("qwen2", "f32"), ("qwen2", "q8")])
def test_interpreter_numbers_are_unchanged(models, name, kv):
    m = models[name]
    ids = [int(t) for t in rng.integers(3, m.config.vocab_size, 9)]
    outs = []
    for passes in (UNFUSED, DEFAULT_PIPELINE):
        ex = _interp(m, kv, passes)
        logits = [ex.prefill(ids[:6], 0, all_logits=True)] + [ex.decode(t, 6 + i) for i, t in enumerate(ids[6:])]
        outs.append((logits, ex.state))
    for a, b in zip(outs[0][0], outs[1][0]):
        np.testing.assert_array_equal(a, b)
    _same_states(outs[0][1], outs[1][1])


@pytest.mark.parametrize("name,kv", [("stories", "f16"), ("qwen2", "q8")])
def test_interpreter_batch_numbers_are_unchanged(models, name, kv):
    m = models[name]
    ids = [int(t) for t in rng.integers(3, m.config.vocab_size, 7)]
    tables = [[5, 2, 9]] * 4 + [[7, 1, 3]] * 3
    positions = [0, 1, 2, 3, 0, 1, 2]
    outs = []
    for passes in (UNFUSED, DEFAULT_PIPELINE):
        ex = _interp(m, kv, passes, BATCH)
        outs.append((ex.batch(ids, positions, tables), ex.state))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    _same_states(outs[0][1], outs[1][1])


# --- the kernel ---------------------------------------------------------------------------
KINDS = ["f32", "f16", "q8"]


def rope_case(data, hd: int, kind: str):
    """Rope attributes and extra operands: both styles, maybe scaled, maybe
    frequency factors, maybe partial rotary."""
    style = data.draw(st.sampled_from(["interleaved", "neox"]))
    attrs = dict(head_dim=hd, theta=data.draw(st.sampled_from([10000.0, 1e6])), style=style)
    rot = hd
    if data.draw(st.booleans()) and hd >= 8:
        rot = hd // 2 if (hd // 2) % 2 == 0 else hd
        attrs["dims"] = rot
    if data.draw(st.booleans()):
        attrs.update(freq_scale=0.25, attn_factor=1.25)
        if data.draw(st.booleans()):
            attrs.update(ext_factor=1.0, yarn_orig_ctx=64)
    factors = [weight(np.linspace(1.0, 4.0, rot // 2).astype(np.float32))] if data.draw(st.booleans()) else []
    return attrs, factors


def head_dim_for(data, kind: str) -> int:
    return data.draw(st.sampled_from([32, 64] if kind == "q8" else [2, 6, 8, 24, 32, 64]))


def check_decoded(got: np.ndarray, want: np.ndarray, kind: str) -> None:
    """Against the numpy reference: native sin/cos may differ from numpy's in
    the last bit, which can move an f16 value one ulp or a q8 value one step."""
    g, w = kv_codec.kv_decode(got), kv_codec.kv_decode(want)
    scale = max(1.0, float(np.abs(w).max()))
    tol = {"f32": 1e-5, "f16": 2e-3, "q8": 2.0 / 127}[kind]
    assert np.abs(g - w).max() <= tol * scale


@given(data=st.data(), kind=st.sampled_from(KINDS), heads=st.integers(1, 3),
       T=st.one_of(st.none(), st.integers(1, 6)), pos=st.integers(0, 40), nt=st.integers(1, 3),
       vw=st.sampled_from(WIDTHS))
@settings(deadline=None, max_examples=60)
def test_rope_kv_write_kernel(data, kind, heads, T, pos, nt, vw):
    hd = head_dim_for(data, kind)
    attrs, factors = rope_case(data, hd, kind)
    n, rows = hd * heads, T or 1
    S = pos + rows + data.draw(st.integers(0, 3))
    ct = kv_cache_type(kind, S, n)
    cache = state_array(ct)
    cache[...] = rng.integers(0, 256, cache.nbytes, dtype=np.uint8).view(cache.dtype).reshape(cache.shape)
    x = act(T, n, 3.0)
    ff_types = [f.type for f in factors]
    sig = sig_for("rope_kv_write", [ct, act_type(T, n), i32(), *ff_types], **attrs)
    got = cache.copy()
    run(sig, [got, x, pos, *factors], pos=pos, T=rows, nthreads=nt, vw=vw, out=got)
    # the two kernels it replaces, one after the other
    rotated = run(sig_for("rope", [act_type(T, n), i32(), *ff_types], **attrs), [x, pos, *factors],
                  pos=pos, T=rows, nthreads=nt, vw=vw)
    two = cache.copy()
    run(sig_for("kv_write", [ct, act_type(T, n), i32()]), [two, rotated, pos], pos=pos, T=rows, nthreads=nt,
        vw=vw, out=two)
    np.testing.assert_array_equal(got.view(np.uint8), two.view(np.uint8))
    want = ops.rope_kv_write_ref(cache.copy(), x, pos, *factors, **attrs)
    untouched = np.r_[0:pos, pos + rows:S]
    np.testing.assert_array_equal(got[untouched].view(np.uint8), cache[untouched].view(np.uint8))
    check_decoded(got[pos:pos + rows], want[pos:pos + rows], kind)


@given(data=st.data(), kind=st.sampled_from(KINDS), heads=st.integers(1, 3),
       spec=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 3)), min_size=1, max_size=4),
       bs=st.sampled_from([1, 3, 4, 16]), nt=st.integers(1, 3), vw=st.sampled_from(WIDTHS))
@settings(deadline=None, max_examples=50)
def test_rope_kv_write_paged_kernel(data, kind, heads, spec, bs, nt, vw):
    hd = head_dim_for(data, kind)
    attrs, factors = rope_case(data, hd, kind)
    n = hd * heads
    b = make_batch(*lens_ks(spec), bs, share=False)
    T = len(b.positions)
    ct = kv_cache_type(kind, b.n_blocks * bs, n)
    cache = pool(kind, b, n)
    x = act(T, n, 3.0)
    ff_types = [f.type for f in factors]
    tab_t = i32("T", b.tables.shape[1])
    sig = sig_for("rope_kv_write_paged", [ct, f32("T", n), i32("T"), tab_t, *ff_types], block_size=bs, **attrs)
    got = cache.copy()
    run(sig, [got, x, b.positions, b.tables, *factors], T=T, nthreads=nt, vw=vw, out=got)
    rotated = run(sig_for("rope", [f32("T", n), i32("T"), *ff_types], **attrs), [x, b.positions, *factors],
                  T=T, nthreads=nt, vw=vw)
    two = cache.copy()
    run(sig_for("kv_write_paged", [ct, f32("T", n), i32("T"), tab_t], block_size=bs),
        [two, rotated, b.positions, b.tables], T=T, nthreads=nt, vw=vw, out=two)
    np.testing.assert_array_equal(got.view(np.uint8), two.view(np.uint8))   # other rows untouched too
    want = ops.rope_kv_write_paged_ref(cache.copy(), x, b.positions, b.tables, *factors, block_size=bs, **attrs)
    written = [b.pool_row(s, int(p)) for s, p in zip(b.seq, b.positions)]
    check_decoded(got[written], want[written], kind)


def test_type_rules():
    ct = kv_cache_type("q8", 8, 64)
    with pytest.raises(ops.ShapeError, match="head_dim"):
        ops.get_op("rope_kv_write").infer([ct, f32(64), i32()], dict(head_dim=16, theta=1e4, style="neox"))
    assert ops.get_op("rope_kv_write").infer([ct, f32(64), i32()], dict(head_dim=32, theta=1e4, style="neox")) == ct
    with pytest.raises(ops.ShapeError):
        ops.get_op("rope_kv_write").infer([kv_cache_type("f32", 8, 64), f32(32), i32()],
                                          dict(head_dim=32, theta=1e4, style="neox"))


# --- compiled models: the same logits and caches with the fusion on and off --------------------------
def _native(m, kv: str, passes, batch=None) -> NativeExecutor:
    art = compile_native(m, NativeOptions(ctx=CTX, kv_type=kv, batch=batch, passes=passes)).artifact
    fused = "rope_kv_write" + ("_paged" if batch else "")
    assert (fused in art.manifest["updates_state"]) == ("fuse_elementwise" in passes)
    return NativeExecutor(art, m.path, threads=2)


def _on_off() -> tuple[tuple[str, ...], tuple[str, ...]]:
    on = default_pipeline("llvm")
    return tuple("fuse_glu" if p == "fuse_elementwise" else p for p in on), on


@pytest.mark.parametrize("name,kv", [("stories", "f16"), ("qwen2", "q8")])
def test_compiled_logits_are_unchanged(models, name, kv):
    m = models[name]
    ids = [int(t) for t in np.random.default_rng(3).integers(3, m.config.vocab_size, 10)]
    outs = []
    for passes in _on_off():
        ex = _native(m, kv, passes)
        logits = [ex.prefill(ids[:7], 0, all_logits=True)] + [ex.decode(t, 7 + i) for i, t in enumerate(ids[7:])]
        outs.append((logits, ex.state.copy()))
    for a, b in zip(outs[0][0], outs[1][0]):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(outs[0][1], outs[1][1])


def test_compiled_batch_logits_are_unchanged(models):
    m = models["qwen2"]
    ids = [int(t) for t in np.random.default_rng(4).integers(3, m.config.vocab_size, 7)]
    tables = [[5, 2, 9]] * 4 + [[7, 1, 3]] * 3
    outs = []
    for passes in _on_off():
        ex = _native(m, "q8", passes, BATCH)
        outs.append((ex.batch(ids, [0, 1, 2, 3, 0, 1, 2], tables), ex.state.copy()))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    np.testing.assert_array_equal(outs[0][1], outs[1][1])
