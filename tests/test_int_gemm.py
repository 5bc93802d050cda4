"""The integer GEMM of prompt chunks (``gemm``: ``compiler/codegen/matmul/gemm.py``,
``gemm_kquants.py``):
agreement with the q8 reference, every token row's bits independent of the
chunk (T, position, register block, K chunk), the decode path kept where
the GEMM does not apply, and graphs of decode rows never marked."""
from __future__ import annotations

import re

import numpy as np
import pytest

from compiler.codegen import matmul
from compiler.codegen.harness import CompiledKernel, sig_for
from compiler.codegen.jit import emit_assembly
from compiler.codegen.matmul.gemm import use_gemm
from compiler.codegen.target import host_target, vnni_width
from ir.ops import qmatmul_ref
from ir.types import TensorType
from kernel_checks import call_with_guard
from test_gguf_layouts import gguf_weight
from test_int_dot import INT_LAYOUTS, check_close as q8_close
from test_int_kquants import check_close as q8k_close, kq_weight

_KERNELS: dict = {}
TS = (1, 2, 3, 7, 17, 64)
KQ_LAYOUTS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


def act(layout: str) -> str:
    return "q8k" if layout in KQ_LAYOUTS else "q8"


def weight(rng, name: str, n: int, k: int):
    return kq_weight(rng, name, n, k) if name in KQ_LAYOUTS else gguf_weight(rng, name, n, k, "normal")


def check_close(got, x, w):
    want = qmatmul_ref(x, w, layout=w.type.layout, act=act(w.type.layout))
    (q8k_close if w.type.layout in KQ_LAYOUTS else q8_close)(got, want, x, w)


def gemm_kernel(k: int, wt: TensorType, vw=None, **attrs) -> CompiledKernel:
    sig = sig_for("qmatmul", [TensorType(("T", k)), wt], layout=wt.layout, act=act(wt.layout),
                  **{"gemm": 64, **attrs})
    key = (sig, vw)
    if key not in _KERNELS:
        _KERNELS[key] = CompiledKernel(sig, vector_width=vw)
    return _KERNELS[key]


def needs_gemm(vw=None):
    w = vnni_width(vw or host_target().vector_width)
    if w is None:
        pytest.skip("no VNNI for the GEMM at this width")
    return w


@pytest.mark.parametrize("vw", [None, 8])
@pytest.mark.parametrize("name", INT_LAYOUTS + KQ_LAYOUTS)
def test_gemm_matches_reference(name, vw):
    """Rows 16, 48 (odd tile counts per thread), K of 3, 33 and 64 blocks
    (1, 5, 8 super-blocks: a K chunk and a tail), every T of the list on
    1..3 threads, more tokens than ``gemm`` quantizes at once; the scratch
    rule holds."""
    needs_gemm(vw)
    rng = np.random.default_rng(31)
    shapes = ((16, 256), (48, 1280), (32, 2048)) if name in KQ_LAYOUTS else ((16, 96), (48, 1056), (32, 2048))
    for n, k in shapes:
        w = weight(rng, name, n, k)
        kern = gemm_kernel(k, w.type, vw)
        assert use_gemm(kern.sig, kern.vector_width)
        x = rng.standard_normal((70, k)).astype(np.float32)
        x[3, :32] = 0.0                                    # a zero block
        for T in TS + (70,):
            for nt in (1, 2, 3):
                check_close(call_with_guard(kern, x[:T], w, T, nt), x[:T], w)


@pytest.mark.parametrize("vw", [None, 8])
@pytest.mark.parametrize("name", ["Q5_0", "Q8_0", "Q4_1", "Q2_K", "Q3_K", "Q4_K", "Q6_K"])
def test_gemm_rows_are_chunk_invariant(name, vw):
    """A token's row has the same bits whatever T, its place in the chunk,
    the register block (``tokens``) and the K chunk (``kc``): chunked
    prefill and the prefix cache rely on it."""
    needs_gemm(vw)
    rng = np.random.default_rng(32)
    n, k = 32, (1280 if name in KQ_LAYOUTS else 1056)
    w = weight(rng, name, n, k)
    x = rng.standard_normal((64, k)).astype(np.float32)
    full = call_with_guard(gemm_kernel(k, w.type, vw), x, w, 64, 2)
    for a, b in ((0, 1), (5, 6), (3, 5), (10, 17), (1, 8), (40, 64), (13, 50)):
        got = call_with_guard(gemm_kernel(k, w.type, vw), x[a:b], w, b - a, 3)
        np.testing.assert_array_equal(got, full[a:b])
    for attrs in ({"tokens": 3}, {"kc": 3}, {"tokens": 1, "kc": 33}, {"gemm": 7}):
        got = call_with_guard(gemm_kernel(k, w.type, vw, **attrs), x[7:30], w, 23, 2)
        np.testing.assert_array_equal(got, full[7:30])


@pytest.mark.parametrize("name,n,k", [("Q5_0", 4864, 896), ("Q6_K", 896, 4864), ("Q2_K", 896, 4864),
                                      ("Q3_K", 4864, 1024)])
def test_gemm_on_qwen_sized_weights(name, n, k):
    needs_gemm()
    rng = np.random.default_rng(33)
    w = weight(rng, name, n, k)
    x = rng.standard_normal((17, k)).astype(np.float32)
    check_close(call_with_guard(gemm_kernel(k, w.type), x, w, 17, 2), x, w)


@pytest.mark.parametrize("vw,n", [(None, 24), (4, 32)])
def test_other_shapes_keep_the_decode_arithmetic(vw, n):
    """Rows that do not fill the tiles (24 at width 16), vector width 4: the
    prompt rows run as before, each with the decode step's bits."""
    if vw is None and vnni_width(host_target().vector_width) != 16:
        pytest.skip("the host's width is not 16")
    rng = np.random.default_rng(34)
    k = 160
    w = gguf_weight(rng, "Q5_0", n, k, "normal")
    kern = gemm_kernel(k, w.type, vw)
    assert not use_gemm(kern.sig, kern.vector_width)
    one = CompiledKernel(sig_for("qmatmul", [TensorType((k,)), w.type], layout="Q5_0", act="q8"), vector_width=vw)
    x = rng.standard_normal((11, k)).astype(np.float32)
    got = call_with_guard(kern, x, w, 11, 2)
    want = np.stack([call_with_guard(one, x[t], w, 1, 2) for t in range(11)])
    np.testing.assert_array_equal(got, want)


def test_gemm_scratch_covers_either_kernel():
    sig = sig_for("qmatmul", [TensorType(("T", 896)), TensorType((64, 896), "f32", "Q5_0")], layout="Q5_0",
                  act="q8", gemm=64)
    assert matmul.scratch_floats(sig) * 4 >= 64 * (896 + 8 * 28) + 28 * 16 * 40


@pytest.mark.parametrize("name", ["Q5_0", "Q4_1", "Q2_K", "Q3_K", "Q4_K", "Q6_K"])
def test_gemm_broadcasts_activations_into_vpdpbusd(name):
    w = needs_gemm()
    asm = emit_assembly(gemm_kernel(1024, TensorType((64, 1024), "f32", name)).module)
    assert re.findall(rf"vpdpbusd\s+[^\n]*\{{1to{w}\}}", asm), asm[:2000]


def test_graphs_of_decode_rows_never_take_the_gemm(tmp_path):
    """``verify`` (speculative decoding) and ``batch_decode`` keep decode's
    arithmetic: no ``gemm``; prefill and batch prompt chunks have it."""
    from compiler.driver import BatchOptions, CompileOptions, build_graphs, load_model
    from passes.int_dot import PROMPT_ROWS
    from test_gguf_frontend import tiny

    p, _ = tiny(tmp_path, "Q8_0")
    m = load_model(p)
    passes_ = ("fuse_dequant", "int_dot")
    gs = build_graphs(m, CompileOptions(passes=passes_, verify=True))
    gs.update(build_graphs(m, CompileOptions(passes=passes_, batch=BatchOptions(4, 16, 3))))
    for name, g in gs.items():
        gemm = [n for n in g.nodes if "gemm" in n.kernel]
        if name in ("prefill", "prefill_all", "batch", "batch_last"):
            assert gemm, name
        else:
            assert not gemm, name
    verify = [n for n in gs["verify"].nodes if n.attrs.get("act") == "q8"]
    assert verify and all(n.kernel["decode_rows"] == PROMPT_ROWS for n in verify)
