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


def _interp_logits(g, mode):
    if mode == "decode":
        state = new_state(g)
        out = None
        for p, t in enumerate([1, 4, 9, 3]):
            out = run(g, {"token": np.int32(t), "pos": np.int32(p)}, state)["logits"]
        return out
    return run(g, {"tokens": np.array([1, 4, 9, 3], np.int32), "pos": np.int32(0)}, new_state(g))["logits"]


def test_fuse_elementwise_makes_one_glu_per_layer_with_the_same_numbers(tmp_path):
    ck = tiny_model(tmp_path)
    for mode in ("decode", "prefill"):
        plain = build_graph(ck.config, ck.weights, mode, all_logits=mode == "prefill")
        fused = run_pipeline(build_graph(ck.config, ck.weights, mode, all_logits=mode == "prefill"),
                             ["fuse_elementwise"])
        ops = [n.op for n in fused.nodes]
        assert ops.count("glu") == ck.config.n_layers and "silu" not in ops and "mul" not in ops
        assert ops.count("rope_kv_write") == ck.config.n_layers   # and the keys' rope + kv_write (tests/test_fuse_rope_kv.py)
        assert len(fused.nodes) == len(plain.nodes) - 2 * ck.config.n_layers
        assert all(n.attrs == {"activation": "silu"} for n in fused.nodes if n.op == "glu")
        np.testing.assert_array_equal(_interp_logits(plain, mode), _interp_logits(fused, mode))


def test_fuse_elementwise_keeps_an_activation_something_else_reads(tmp_path):
    ck = tiny_model(tmp_path)
    g = build_graph(ck.config, ck.weights, "decode")
    act = next(n for n in g.nodes if n.op == "silu")
    g.outputs.append(act.output)          # another reader: the activation must stay written out
    g = run_pipeline(g, ["fuse_elementwise"])
    ops = [n.op for n in g.nodes]
    assert ops.count("silu") == 1 and ops.count("glu") == ck.config.n_layers - 1


def _groups_are_independent(g, plan):
    """Between two barriers no op reads another's result, and no op writes
    arena bytes another op of the stretch reads or writes (checked from the
    plan's intervals, not from passes.barriers)."""
    from passes.barriers import barrier_before
    from passes.plan_arena import inplace_roots

    roots = inplace_roots(g)
    size = {iv.name: iv.size for iv in plan.intervals}

    def span(v):
        if v.kind != "node" or v.name not in plan.offsets:
            return None
        o = plan.offsets[v.name]
        return o, o + size[roots.get(v.name, v.name)]

    def hit(a, b):
        return a is not None and b is not None and a[0] < b[1] and b[0] < a[1]

    wait = barrier_before(g, plan)
    assert not wait[0]
    stretch = []
    for n, w in zip(g.nodes, wait):
        if w:
            stretch = []
        made = {id(m.output) for m in stretch}
        assert not any(id(v) in made for v in n.inputs), f"{n.op} reads a result of its stretch"
        out = span(n.output)
        for m in stretch:
            assert not any(hit(out, span(v)) for v in [*m.inputs, m.output]), f"{n.op} overwrites {m.op}'s bytes"
            assert not any(hit(span(v), span(m.output)) for v in n.inputs)
        stretch.append(n)
    return sum(wait) + 1


def test_schedule_groups_independent_ops_and_keeps_the_numbers(tmp_path):
    from passes.barriers import barrier_count
    from passes.plan_arena import check_plan, plan_arena

    ck = tiny_model(tmp_path)
    for mode in ("decode", "prefill"):
        plain = run_pipeline(build_graph(ck.config, ck.weights, mode, all_logits=mode == "prefill"),
                             ["fuse_dequant", "fuse_elementwise"])
        sched = run_pipeline(build_graph(ck.config, ck.weights, mode, all_logits=mode == "prefill"),
                             ["fuse_dequant", "fuse_elementwise", "schedule"])
        assert sorted(n.output.name for n in sched.nodes) == sorted(n.output.name for n in plain.nodes)
        seen = {v.name for v in [*sched.inputs, *sched.weights.values(), *sched.states.values()]}
        for n in sched.nodes:                  # still a topological order
            assert all(v.name in seen for v in n.inputs), n.op
            seen.add(n.output.name)
        np.testing.assert_array_equal(_interp_logits(plain, mode), _interp_logits(sched, mode))
        symbols = {"T": 4}
        p_plain, p_sched = plan_arena(plain, symbols), plan_arena(sched, symbols)
        check_plan(p_sched)
        n_plain, n_sched = _groups_are_independent(plain, p_plain), _groups_are_independent(sched, p_sched)
        assert n_sched == barrier_count(sched, p_sched)
        assert n_sched <= n_plain < len(plain.nodes) + 1


def test_schedule_puts_a_layers_biases_side_by_side(tmp_path):
    """Qwen2 writes q = x Wq + bq, k = x Wk + bk, v = ...: a dependency every
    other op. Scheduled, the projections, then the biases, then the RoPEs
    share a stretch each."""
    from compiler.driver import load_model
    from passes.barriers import barrier_count
    from passes.plan_arena import plan_arena
    from test_families import write_family

    m = load_model(write_family(tmp_path / "qwen2.gguf", "qwen2", "F32"), None)
    from passes.barriers import barrier_before

    counts = []
    for names in (["fuse_dequant", "fuse_elementwise"], ["fuse_dequant", "fuse_elementwise", "schedule"]):
        g = run_pipeline(build_graph(m.config, m.weights, "decode"), names)
        counts.append(_groups_are_independent(g, plan_arena(g)))
        assert counts[-1] == barrier_count(g, plan_arena(g))
    stretch, stretches = [], []
    for n, w in zip(g.nodes, barrier_before(g, plan_arena(g))):
        if w:
            stretches.append(stretch)
            stretch = []
        stretch.append(n.inputs[1].name if n.op in ("matmul", "bias_add") else n.op)
    for i in range(m.config.n_layers):
        assert [f"blk.{i}.attn_{w}" for w in "qkv"] in stretches
        assert [f"blk.{i}.attn_{w}.bias" for w in "qkv"] in stretches
    assert counts[1] < counts[0], counts
