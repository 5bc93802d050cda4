"""The IR itself: building, verifying, printing, DOT export, interpreting."""
from __future__ import annotations

import numpy as np
import pytest

from frontends.arch import ModelConfig, build_graph, expected_shapes, WeightInfo
from frontends.llama2c import load_llama2c
from frontends.llama2c_writer import write_llama2c
from ir.dot import to_dot, to_networkx
from ir.graph import Graph, WeightRef
from ir.interp import new_state, run
from ir.printer import print_graph
from ir.types import TensorType
from ir.verify import VerifyError, verify


def tiny_model(tmp_path, version=0, **kw):
    base = dict(arch="llama", dim=16, hidden_dim=24, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=32,
                seq_len=16)
    base.update(kw)
    cfg = ModelConfig(**base)
    r = np.random.default_rng(1)
    t = {k: r.standard_normal(s).astype(np.float32) * 0.5 for k, s in expected_shapes(cfg).items()}
    p = tmp_path / "tiny.bin"
    write_llama2c(p, cfg, t, version=version, group_size=8)
    return load_llama2c(p)


def test_decode_graph_text_form(tmp_path):
    ck = tiny_model(tmp_path)
    g = build_graph(ck.config, ck.weights, "decode", name="tiny")
    verify(g)
    text = print_graph(g)
    lines = text.splitlines()
    assert lines[0] == "graph tiny.decode(%token: i32[], %pos: i32[]) {"
    assert "  %0 = embedding(@token_embd, %token) : f32[16]" in lines
    assert "  %1 = rmsnorm(%0, @blk.0.attn_norm) {eps=1e-05} : f32[16]" in lines
    assert any(l.strip().startswith("%") and "= rope(" in l and "style=interleaved" in l for l in lines)
    assert any("= kv_write($k_cache.1," in l for l in lines)
    assert lines[-2] == "  return %logits"
    # one line a node, plus header, weights, states, return and closing brace
    assert len(lines) == len(g.nodes) + len(g.weights) + len(g.states) + 3
    # stable: building twice prints the same text
    assert print_graph(build_graph(ck.config, ck.weights, "decode", name="tiny")) == text


def test_prefill_graph_is_symbolic_in_T(tmp_path):
    ck = tiny_model(tmp_path)
    g = build_graph(ck.config, ck.weights, "prefill", name="tiny")
    verify(g)
    assert g.inputs[0].type == TensorType(("T",), "i32")
    mm = [n for n in g.nodes if n.op == "matmul"]
    assert mm[0].output.type.shape == ("T", 16)  # matrix-matrix: a row per token
    assert g.outputs[0].type.shape == (32,)
    g_all = build_graph(ck.config, ck.weights, "prefill", all_logits=True, name="tiny")
    assert g_all.outputs[0].type.shape == ("T", 32)


def test_prefill_equals_token_by_token_decode(tmp_path):
    ck = tiny_model(tmp_path)
    dec = build_graph(ck.config, ck.weights, "decode")
    pre = build_graph(ck.config, ck.weights, "prefill", all_logits=True)
    ids = [1, 5, 7, 30, 2, 9]
    st = new_state(pre)
    all_rows = run(pre, {"tokens": np.array(ids, np.int32), "pos": np.int32(0)}, st)["logits"]
    st2 = new_state(dec)
    for p, t in enumerate(ids):
        row = run(dec, {"token": np.int32(t), "pos": np.int32(p)}, st2)["logits"]
        np.testing.assert_allclose(row, all_rows[p], rtol=1e-4, atol=1e-4)
    for k in st:
        np.testing.assert_allclose(st[k], st2[k], rtol=1e-5, atol=1e-5)
    # a chunked prefill continues from the cache
    st3 = new_state(pre)
    run(pre, {"tokens": np.array(ids[:4], np.int32), "pos": np.int32(0)}, st3)
    tail = run(pre, {"tokens": np.array(ids[4:], np.int32), "pos": np.int32(4)}, st3)["logits"]
    np.testing.assert_allclose(tail, all_rows[4:], rtol=1e-4, atol=1e-4)


def test_verifier_catches_errors(tmp_path):
    ck = tiny_model(tmp_path)
    g2 = build_graph(ck.config, ck.weights, "decode")
    # use before definition
    g2.nodes.insert(0, g2.nodes.pop(5))
    with pytest.raises(VerifyError, match="not defined before use"):
        verify(g2)
    g3 = build_graph(ck.config, ck.weights, "decode")
    g3.nodes[1].output.type = TensorType((17,))
    with pytest.raises(VerifyError, match="its rule gives"):
        verify(g3)
    g4 = build_graph(ck.config, ck.weights, "decode")
    g4.nodes[2].op = "no_such_op"
    with pytest.raises(VerifyError, match="unknown op"):
        verify(g4)
    g5 = Graph("w")
    g5.add_weight("w", TensorType((4, 4), "f32", "F32"), WeightRef("x.bin", 0, 10))
    x = g5.add_input("x", TensorType((4,)))
    g5.set_outputs(g5.add_node("matmul", [x, g5.weights["w"]]))
    with pytest.raises(VerifyError, match="10 bytes stored"):
        verify(g5)


def test_dot_export_parses(tmp_path):
    ck = tiny_model(tmp_path)
    g = build_graph(ck.config, ck.weights, "decode", name="tiny")
    dot = to_dot(g)
    assert dot.startswith('digraph "tiny.decode" {')
    nxg = to_networkx(g)
    assert nxg.number_of_nodes() == len(g.nodes) + len(g.weights) + len(g.states) + len(g.inputs) + 1
    kinds = {d["kind"] for _, d in nxg.nodes(data=True)}
    assert kinds == {"input", "weight", "state", "op", "output"}
    for n in g.nodes:
        assert f'"node %{n.output.name}" [label="{n.op}' in dot  # graphviz renames ids that start with %
    gv = pytest.importorskip("graphviz")
    src = gv.Source(dot)
    import shutil

    if shutil.which("dot") is None:
        pytest.skip("graphviz's dot program is not installed; DOT text checked above")
    svg = src.pipe(format="svg").decode()
    assert "<svg" in svg and "embedding" in svg
