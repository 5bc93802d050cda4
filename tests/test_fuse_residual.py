"""Residual adds and biases as the epilogue of the repacked matmul before
them (``qmatmul_add``: passes/fuse_residual).

The rewrite on whole models (attention output and FFN down projections of
llama and qwen2, qwen2's q, k and v biases; Gemma 3 normalises those
products first, so its adds stay), the interpreter's logits with and without it (bit for bit), the
kernel against the product kernel plus the add (bit for bit, every row
count, 1-3 threads), and compiled models' logits for decode steps, prompt
rows and served batches with the fusion on and off (bit for bit).
"""
from __future__ import annotations

import numpy as np
import pytest

from compiler.codegen import matmul
from compiler.codegen.harness import CompiledKernel, sig_for
from compiler.driver import BatchOptions, CompileOptions, build_graphs
from compiler.native import NativeOptions, compile_native, plan_native
from compiler.pipeline import run_pipeline
from ir.types import TensorType
from kernel_checks import call_with_guard
from runtime.native import NativeExecutor
from test_int_gemm import act, weight
from test_repack import CTX, MODELS, VOCAB, prefill_logits, models, width_or_skip  # noqa: F401 (fixture)
from test_repacked_kernels import kernel, repacked, width_or_skip as kernel_width

PASSES = ("fuse_dequant", "fuse_elementwise", "int_dot", "repack")
FUSED = PASSES + ("fuse_residual",)
#: products that feed a residual add or a bias, per layer (qwen2: q, k and v have biases)
EPILOGUES = {"q8_0": 5, "q4_0": 2, "q5_0": 5, "q4_k": 0}


def count(graph, op: str) -> int:
    return sum(n.op == op for n in graph.nodes)


@pytest.mark.parametrize("name", list(MODELS))
def test_residual_adds_become_epilogues_with_the_same_numbers(models, name):
    m = models[name]
    plain = build_graphs(m, CompileOptions(ctx=CTX, passes=PASSES, repack_width=16))
    fused = build_graphs(m, CompileOptions(ctx=CTX, passes=FUSED, repack_width=16))
    n = EPILOGUES[name] * m.config.n_layers
    for gname, g in fused.items():
        assert count(g, "qmatmul_add") == n, gname
        adds = lambda g: count(g, "add") + count(g, "bias_add")  # noqa: E731
        assert adds(g) == adds(plain[gname]) - n, gname
        for node in g.nodes:
            if node.op == "qmatmul_add":
                assert node.inputs[1].type.repack
                r = node.inputs[2]
                assert r.type == node.output.type or (r.kind == "weight" and r.type.rank == 1)
    ids = [1, 7, 42, 9, 300]
    np.testing.assert_array_equal(prefill_logits(fused, ids), prefill_logits(plain, ids))


def test_only_repacked_products_with_one_reader(models):
    m = models["q8_0"]
    g = build_graphs(m, CompileOptions(ctx=CTX, passes=PASSES[:-1] + ("fuse_residual",)))["decode"]
    assert count(g, "qmatmul_add") == 0            # no repack: the file's layout has no epilogue kernel
    all_fused = count(build_graphs(m, CompileOptions(ctx=CTX, passes=FUSED, repack_width=16))["decode"],
                      "qmatmul_add")
    g = build_graphs(m, CompileOptions(ctx=CTX, passes=PASSES, repack_width=16))["decode"]
    first = next(nd for nd in g.nodes if nd.op == "qmatmul" and any(
        o.op == "add" and nd.output in o.inputs for o in g.nodes))
    g.outputs.append(first.output)                # something else reads a product
    g = run_pipeline(g, ["fuse_residual"])
    assert count(g, "qmatmul_add") == all_fused - 1 and all_fused == EPILOGUES["q8_0"] * m.config.n_layers


@pytest.mark.parametrize("base", ["Q5_0", "Q8_0", "Q4_K", "Q6_K"])
def test_the_epilogue_adds_the_residual_to_the_products_bits(base):
    """Every row count (a decode row, a chunk with a tail of the tokens a
    call quantizes, odd tile shares on 1-3 threads): the product kernel's
    result plus the residual (or a bias, every row) in float32, bit for bit."""
    W = kernel_width(None)
    rng = np.random.default_rng(8)
    n, k = 48, (1280 if base.endswith("_K") else 1056)
    wr = repacked(weight(rng, base, n, k), W)
    x = rng.standard_normal((70, k)).astype(np.float32)
    r = rng.standard_normal((70, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    for shape, rows, addend in (((k,), 1, "residual"), (("T", k), 70, "residual"), (("T", k), 70, "bias")):
        rt = TensorType((n,)) if addend == "bias" else TensorType(shape[:-1] + (n,))
        sig = sig_for("qmatmul_add", [TensorType(shape), wr.type, rt], layout=wr.type.layout, act=act(base))
        fused = CompiledKernel(sig)
        plain = kernel(shape, wr.type)
        xs, rs = (x[0], r[0]) if rows == 1 else (x, bias if addend == "bias" else r)
        want = call_with_guard(plain, xs, wr, rows, 2) + rs
        for nt in (1, 2, 3):
            got = np.zeros_like(want)
            need = matmul.scratch_floats(sig)
            for tid in range(nt):
                scratch = np.full(need + 256, 12345.0, np.float32)
                fused(got, [xs, wr, rs], T=rows, tid=tid, nthreads=nt, scratch=scratch)
                assert np.all(scratch[need:] == 12345.0)
            np.testing.assert_array_equal(got, want)


def compiled_logits(m, passes: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``m`` compiled with ``passes`` (no cache): the logits of every prompt
    row, of decode steps over the same ids, and of a served batch's rows."""
    rng = np.random.default_rng(4)
    ids = [1] + [int(t) for t in rng.integers(3, VOCAB, 20)]
    bo = BatchOptions(block_size=4, n_blocks=24, max_batch=4)
    one = NativeExecutor(compile_native(m, NativeOptions(ctx=CTX, prefill_chunk=8, passes=passes,
                                                         use_cache=False)).artifact, m.path, threads=3)
    rows = np.array(one.prefill(ids, 0, all_logits=True))
    one.reset()
    steps = np.stack([np.array(one.decode(t, p)) for p, t in enumerate(ids)])
    b = NativeExecutor(compile_native(m, NativeOptions(ctx=CTX, prefill_chunk=8, passes=passes, batch=bo,
                                                       use_cache=False)).artifact, m.path, threads=2)
    batch = np.array(b.batch(ids[:8], list(range(8)), [list(range(6))] * 8))
    return rows, steps, batch


@pytest.mark.parametrize("name", ["q8_0", "q5_0"])
def test_compiled_logits_do_not_change(models, name):
    """Decode steps, prompt rows and the rows of a served batch: the same
    bits with and without the epilogues."""
    width_or_skip()
    m = models[name]
    got = {}
    for label, passes in (("plain", PASSES), ("fused", FUSED)):
        got[label] = compiled_logits(m, passes)
        planned = plan_native(m, NativeOptions(ctx=CTX, prefill_chunk=8, passes=passes))
        assert (count(planned.graphs["decode"], "qmatmul_add") > 0) == (label == "fused")
    for a, b in zip(got["plain"], got["fused"]):
        np.testing.assert_array_equal(a, b)
    assert np.abs(got["fused"][0]).max() > 0
