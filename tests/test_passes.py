"""Passes leave the interpreter's output unchanged."""
from __future__ import annotations

import numpy as np

from compiler.pipeline import run_pipeline
from frontends.arch import build_graph
from ir.interp import new_state, run
from ir.printer import print_graph

from test_ir import tiny_model


def test_fuse_dequant_removes_every_dequant_and_keeps_outputs(tmp_path):
    ck = tiny_model(tmp_path, version=2)
    plain = build_graph(ck.config, ck.weights, "prefill", all_logits=True)
    n_deq = sum(n.op == "dequant" for n in plain.nodes)
    assert n_deq == 7 * ck.config.n_layers + 1  # every matrix, and the tied classifier
    ids = np.array([1, 4, 9, 3], np.int32)
    before = run(plain, {"tokens": ids, "pos": np.int32(0)}, new_state(plain))["logits"]
    fused = run_pipeline(build_graph(ck.config, ck.weights, "prefill", all_logits=True), ["fuse_dequant"])
    ops = [n.op for n in fused.nodes]
    assert "dequant" not in ops and "matmul" not in ops
    assert ops.count("qmatmul") == n_deq
    assert "qmatmul[L2C_Q8G8](" in print_graph(fused)
    after = run(fused, {"tokens": ids, "pos": np.int32(0)}, new_state(fused))["logits"]
    np.testing.assert_array_equal(before, after)


def test_pipeline_dumps_each_pass(tmp_path):
    ck = tiny_model(tmp_path, version=2)
    g = build_graph(ck.config, ck.weights, "decode")
    run_pipeline(g, ["fuse_dequant", "dce"], dump_dir=str(tmp_path / "dump"))
    names = sorted(p.name for p in (tmp_path / "dump").iterdir())
    assert names == ["00-input.txt", "01-fuse_dequant.txt", "02-dce.txt"]
    assert "dequant(" in (tmp_path / "dump" / "00-input.txt").read_text()
    assert "dequant(" not in (tmp_path / "dump" / "01-fuse_dequant.txt").read_text()
