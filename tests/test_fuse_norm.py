"""RMSNorms inside the quantization of the repacked matmuls that read them
(``norm_eps``: passes/fuse_norm).

The rewrite on whole models (each layer's attention and FFN norms, and the
final norm where the head is repacked; Gemma 3's per-head and
post-projection norms stay), the interpreter's logits with and without it
(bit for bit), the fused kernel against the rmsnorm kernel followed by the
product (bit for bit, every row count, 1-3 threads, F32 and F16 norm
weights, with and without an epilogue), and compiled models' logits for
decode steps, prompt rows and served batches with the fusion on and off
(bit for bit).
"""
from __future__ import annotations

import numpy as np
import pytest

from compiler.codegen import matmul
from compiler.codegen.harness import CompiledKernel, sig_for
from compiler.driver import CompileOptions, build_graphs
from compiler.native import NativeOptions, plan_native
from compiler.pipeline import run_pipeline
from ir.types import TensorType
from kernel_checks import call_with_guard
from test_fuse_residual import compiled_logits
from test_int_gemm import act, weight
from test_repack import CTX, MODELS, prefill_logits, models, width_or_skip  # noqa: F401 (fixture)
from test_repacked_kernels import kernel, repacked, width_or_skip as kernel_width

PASSES = ("fuse_dequant", "fuse_elementwise", "int_dot", "repack", "fuse_residual")
FUSED = PASSES + ("fuse_norm",)


def count(graph, op: str) -> int:
    return sum(n.op == op for n in graph.nodes)


def normed(graph) -> list:
    return [n for n in graph.nodes if "norm_eps" in n.attrs]


@pytest.mark.parametrize("name", list(MODELS))
def test_norms_move_into_the_matmuls_with_the_same_numbers(models, name):
    m = models[name]
    plain = build_graphs(m, CompileOptions(ctx=CTX, passes=PASSES, repack_width=16))
    fused = build_graphs(m, CompileOptions(ctx=CTX, passes=FUSED, repack_width=16))
    for gname, g in fused.items():
        gone = count(plain[gname], "rmsnorm") - count(g, "rmsnorm")
        # each layer's attention and FFN input norms and the final one; Gemma 3's per-head q/k norms
        # and its norms of the projections' outputs (read by adds) stay
        assert gone == 2 * m.config.n_layers + 1, gname
        for node in normed(g):
            assert node.inputs[1].type.repack
            nw = node.inputs[-1]
            assert nw.kind == "weight" and nw.type.shape == (node.inputs[0].type.shape[-1],)
        assert len(normed(g)) == 5 * m.config.n_layers + 1, gname     # q, k, v, gate, up; the head
    ids = [1, 7, 42, 9, 300]
    np.testing.assert_array_equal(prefill_logits(fused, ids), prefill_logits(plain, ids))


def test_only_norms_whose_readers_all_take_it(models):
    """A norm that something else reads too (here: a graph output) stays,
    and so does its readers' input."""
    m = models["q8_0"]
    g = build_graphs(m, CompileOptions(ctx=CTX, passes=PASSES, repack_width=16))["decode"]
    first = next(nd for nd in g.nodes if nd.op == "rmsnorm")
    g.outputs.append(first.output)
    all_fused = count(g, "rmsnorm")
    g = run_pipeline(g, ["fuse_norm"])
    assert count(g, "rmsnorm") == 1 + (all_fused - (2 * m.config.n_layers + 1))
    assert all(first.output is not n.inputs[0] or "norm_eps" not in n.attrs for n in g.nodes)
    g2 = build_graphs(m, CompileOptions(ctx=CTX, passes=PASSES[:-2] + ("fuse_norm",)))["decode"]
    assert not normed(g2)                      # no repack: the file's layout kernels have no norm


@pytest.mark.parametrize("base", ["Q5_0", "Q8_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("norm_type", ["F32", "F16"])
def test_the_fused_kernel_gives_the_two_kernels_bits(base, norm_type):
    """Every row count (a decode row, a chunk with a tail of the tokens a
    call quantizes, odd tile shares on 1-3 threads), with and without an
    epilogue: the rmsnorm kernel's rows fed to the product kernel, bit for bit."""
    W = kernel_width(None)
    rng = np.random.default_rng(9)
    n, k = 48, (1280 if base.endswith("_K") else 1056)
    wr = repacked(weight(rng, base, n, k), W)
    x = (3 * rng.standard_normal((70, k))).astype(np.float32)
    r = rng.standard_normal((70, n)).astype(np.float32)
    g = (1 + 0.1 * rng.standard_normal(k)).astype(np.float16 if norm_type == "F16" else np.float32)
    gt = TensorType((k,), "f32", "F16") if norm_type == "F16" else TensorType((k,))
    eps = 1e-6
    for shape, rows in (((k,), 1), (("T", k), 70)):
        norm = CompiledKernel(sig_for("rmsnorm", [TensorType(shape), gt], eps=eps))
        xn = np.zeros((rows, k) if rows > 1 else (k,), np.float32)
        norm(xn, [x[0] if rows == 1 else x, g], T=rows, tid=0, nthreads=1)
        plain = call_with_guard(kernel(shape, wr.type), xn, wr, rows, 2)
        xs, rs = (x[0], r[0]) if rows == 1 else (x, r)
        for op, extra, want in (("qmatmul", [], plain), ("qmatmul_add", [rs], plain + rs)):
            types = [TensorType(shape), wr.type] + ([TensorType(rs.shape if rows == 1 else ("T", n))] if extra else [])
            sig = sig_for(op, types + [gt], layout=wr.type.layout, act=act(base), norm_eps=eps)
            fused = CompiledKernel(sig)
            for nt in (1, 2, 3):
                got = np.zeros_like(want)
                need = matmul.scratch_floats(sig)
                for tid in range(nt):
                    scratch = np.full(need + 256, 12345.0, np.float32)
                    fused(got, [xs, wr, *extra, g], T=rows, tid=tid, nthreads=nt, scratch=scratch)
                    assert np.all(scratch[need:] == 12345.0)
                np.testing.assert_array_equal(got, want, err_msg=f"{op} rows={rows} threads={nt}")


@pytest.mark.parametrize("name", ["q8_0", "q5_0", "q4_k"])
def test_compiled_logits_do_not_change(models, name):
    """Decode steps, prompt rows and the rows of a served batch: the same
    bits with and without the norms fused."""
    width_or_skip()
    m = models[name]
    got = {}
    for label, passes in (("plain", PASSES), ("fused", FUSED)):
        got[label] = compiled_logits(m, passes)
        planned = plan_native(m, NativeOptions(ctx=CTX, prefill_chunk=8, passes=passes))
        assert bool(normed(planned.graphs["decode"])) == (label == "fused")
    for a, b in zip(got["plain"], got["fused"]):
        np.testing.assert_array_equal(a, b)
    assert np.abs(got["fused"][0]).max() > 0
