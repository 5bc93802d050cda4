"""The integer path of qmatmul (``act="q8"``): activations quantized to
Q8_0-style blocks, int8 dot products (``compiler/codegen/matmul/int_q8.py``).

The numpy reference is checked against a slow formula written with Python
ints; the native kernel against the reference, called once per thread id as
the step function would; the ``int_dot`` pass on graphs; and a synthetic
Q8_0 GGUF model through the interpreter and through native code."""
from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import passes.int_dot  # noqa: F401  (registers the pass)
from compiler.codegen import matmul
from compiler.codegen.harness import CompiledKernel, run_kernel_like_reference, sig_for
from compiler.codegen.jit import emit_assembly
from compiler.codegen.target import host_target
from ir.int_dot import int_blocks, quantize_q8_rows
from ir.ops import ShapeError, WeightData, get_op, qmatmul_ref
from ir.types import TensorType
from kernel_checks import call_with_guard, check_within, portable_target, same_tokens_interp_and_native
from test_gguf_layouts import gguf_weight

INT_LAYOUTS = ["Q8_0", "Q4_0", "Q5_0", "Q4_1", "Q5_1"]
#: bytes per block
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q5_0": 22, "Q4_1": 20, "Q5_1": 24}
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
_KERNELS: dict = {}


def compiled(sig, vector_width=None, portable=False) -> CompiledKernel:
    """One kernel per signature, width and path (``portable``: compiled for
    the host without VNNI, so the portable widening multiply)."""
    key = (sig, vector_width, portable)
    if key not in _KERNELS:
        _KERNELS[key] = CompiledKernel(sig, vector_width=vector_width,
                                       target=portable_target(vector_width) if portable else None)
    return _KERNELS[key]


# --- an independent slow formula ---------------------------------------------------------------
def _f16_bits_to_float(lo: int, hi: int) -> float:
    return float(np.frombuffer(bytes([lo, hi]), "<f2")[0])


def slow_weight_block(name: str, blk: bytes) -> tuple[float, float, list[int]]:
    """(d, m, 32 integer quants) of one stored block, byte by byte: value =
    d * q + m (m = 0 for the symmetric layouts)."""
    d = _f16_bits_to_float(blk[0], blk[1])
    m = _f16_bits_to_float(blk[2], blk[3]) if name in ("Q4_1", "Q5_1") else 0.0
    if name == "Q8_0":
        return d, m, [b - 256 if b >= 128 else b for b in blk[2:34]]
    qs = blk[-16:]
    nib = [qs[j] & 15 for j in range(16)] + [qs[j] >> 4 for j in range(16)]
    if name == "Q4_0":
        return d, m, [v - 8 for v in nib]
    if name == "Q4_1":
        return d, m, nib
    at = 2 if name == "Q5_0" else 4
    qh = int.from_bytes(blk[at:at + 4], "little")
    bias = 16 if name == "Q5_0" else 0
    return d, m, [(nib[j] | (((qh >> j) & 1) << 4)) - bias for j in range(32)]


def slow_quantize_block(xs: np.ndarray) -> tuple[float, list[int]]:
    """llama.cpp's x86 quantize_row_q8_0 for one block, one value at a time
    (float32 arithmetic, Python's round-half-to-even)."""
    amax = np.float32(0)
    for v in xs:
        amax = max(amax, abs(np.float32(v)))
    d = float(np.float16(np.float32(amax) / np.float32(127)))
    inv = np.float32(127) / amax if amax > 0 else np.float32(0)
    return d, [int(round(float(np.float32(v) * inv))) for v in xs]


def slow_int_matvec(x: np.ndarray, w: WeightData) -> np.ndarray:
    name = w.type.layout
    n, k = (int(s) for s in w.type.shape)
    nb, bb = k // 32, BLOCK_BYTES[name]
    raw = bytes(np.asarray(w.raw, np.uint8))
    xq = [slow_quantize_block(x[b * 32:(b + 1) * 32]) for b in range(nb)]
    out = []
    for r in range(n):
        total = 0.0
        for b in range(nb):
            o = (r * nb + b) * bb
            dw, mw, qw = slow_weight_block(name, raw[o:o + bb])
            dx, qx = xq[b]
            total += dw * dx * sum(p * q for p, q in zip(qw, qx))  # exact ints, then float64
            total += mw * dx * sum(qx)
        out.append(total)
    return np.array(out)


def int_scale(x: np.ndarray, w: WeightData) -> np.ndarray:
    """sum over blocks of |d_w d_x q_w q_x| (+ |m_w d_x sum q_x| for the
    offset layouts) per output: the size of the terms."""
    k = int(w.type.shape[1])
    dx, qx = quantize_q8_rows(np.asarray(x, np.float32).reshape(-1, k))
    dw, qw, mw = int_blocks(w)
    adx = np.abs(dx.astype(np.float64))
    s = np.einsum("nbj,mbj->mnb", np.abs(qw.astype(np.float64)), np.abs(qx.astype(np.float64)))
    s = np.einsum("mnb,nb,mb->mn", s, np.abs(dw.astype(np.float64)), adx)
    if mw is not None:
        s += (adx * np.abs(qx.sum(axis=2, dtype=np.int64))) @ np.abs(mw.astype(np.float64)).T
    return s.reshape(np.shape(x)[:-1] + (int(w.type.shape[0]),))


def check_close(got, want, x, w, rel=1e-5):
    check_within(got, want, int_scale(x, w), rel)


# --- the reference ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", INT_LAYOUTS)
def test_reference_matches_slow_formula(name):
    rng = np.random.default_rng(3)
    n, k = 5, 128
    w = gguf_weight(rng, name, n, k, "extreme")
    x = rng.standard_normal(k).astype(np.float32) * np.float32(3.0)
    x[32:64] = 0.0                                   # a zero block: d = 0, q = 0
    x[64:96] = np.linspace(-1.0, 1.0, 32, dtype=np.float32) * np.float32(127 / 2)  # halves: ties
    with np.errstate(all="ignore"):
        got = qmatmul_ref(x, w, layout=name, act="q8")
        want = slow_int_matvec(x, w)
    assert got.dtype == np.float32 and got.shape == (n,)
    np.testing.assert_array_equal(got, want.astype(np.float32))


@pytest.mark.parametrize("name", INT_LAYOUTS)
def test_int_blocks_give_the_dequantized_values(name):
    """d * q (+ m) in float32, as ggml's dequantizers compute it, is the layout's own dequantization."""
    w = gguf_weight(np.random.default_rng(5), name, 6, 96, "extreme")
    d, q, m = int_blocks(w)
    assert (m is None) == (name not in ("Q4_1", "Q5_1"))
    v = d[:, :, None] * q.astype(np.float32) + (0 if m is None else m[:, :, None])
    np.testing.assert_array_equal(v.reshape(6, 96), w.to_f32())


def test_reference_quantizer_rounds_half_to_even_and_stores_f16_scales():
    x = np.zeros(32, np.float32)
    x[0], x[1], x[2], x[3] = 127.0, 0.5, 1.5, -2.5
    d, q = quantize_q8_rows(x[None])
    assert d[0, 0] == np.float32(1.0)
    assert list(q[0, 0, :4]) == [127, 0, 2, -2]
    x = np.full(32, 0.1, np.float32)
    d, q = quantize_q8_rows(x[None])
    assert d[0, 0] == np.float32(np.float16(np.float32(0.1) / np.float32(127)))
    assert np.all(q == 127)


def test_reference_default_path_unchanged_and_prefill_rows():
    rng = np.random.default_rng(4)
    w = gguf_weight(rng, "Q8_0", 7, 96)
    x = rng.standard_normal((3, 96)).astype(np.float32)
    np.testing.assert_array_equal(qmatmul_ref(x, w, layout="Q8_0"), x @ w.to_f32().T)
    rows = qmatmul_ref(x, w, layout="Q8_0", act="q8")
    for t in range(3):
        np.testing.assert_array_equal(rows[t], qmatmul_ref(x[t], w, layout="Q8_0", act="q8"))
    # int8 rounding of x: close to the float result, not equal
    assert np.abs(rows - qmatmul_ref(x, w, layout="Q8_0")).max() <= 0.02 * np.abs(rows).max()


@pytest.mark.parametrize("layout", ["Q4_K", "Q3_K", "F32", "BF16"])
def test_shape_rule_refuses_other_layouts(layout):
    k = 256
    wt = TensorType((8, k), "f32", None if layout == "F32" else layout)
    attrs = {"layout": wt.layout} if wt.layout else {}
    with pytest.raises(ShapeError):
        get_op("qmatmul").infer([TensorType((k,)), wt], {**attrs, "act": "q8"})


def test_shape_rule_accepts_int_layouts_and_refuses_unknown_act():
    for name in INT_LAYOUTS:
        wt = TensorType((8, 64), "f32", name)
        assert get_op("qmatmul").infer([TensorType((64,)), wt], {"layout": name, "act": "q8"}).shape == (8,)
    with pytest.raises(ShapeError):
        get_op("qmatmul").infer([TensorType((64,)), TensorType((8, 64), "f32", "Q8_0")],
                                {"layout": "Q8_0", "act": "q4"})


# --- the native kernel ----------------------------------------------------------------------------
def run_int(x, w, nt, vw=None, portable=False):
    k = int(w.type.shape[1])
    sig = sig_for("qmatmul", [TensorType((k,) if x.ndim == 1 else ("T", k)), w.type],
                  layout=w.type.layout, act="q8")
    sym = {"T": x.shape[0]} if x.ndim == 2 else None
    got = run_kernel_like_reference(sig, [x, w], nthreads=nt, symbols=sym,
                                    kernel=compiled(sig, vw, portable), scratch_floats=1 << 16)
    assert matmul.scratch_floats(sig) <= 1 << 16
    return got, qmatmul_ref(x, w, layout=w.type.layout, act="q8")


@settings(max_examples=60, **SETTINGS)
@given(name=st.sampled_from(INT_LAYOUTS), n=st.sampled_from([1, 3, 5, 7, 13, 33]),
       nb=st.sampled_from([1, 2, 3, 4, 5, 7, 20, 33, 64]), nt=st.integers(1, 3),
       vw=st.sampled_from([None, 8]), scales=st.sampled_from(["normal", "extreme"]),
       seed=st.integers(0, 2**31))
def test_int_matvec(name, n, nb, nt, vw, scales, seed):
    rng = np.random.default_rng(seed)
    k = 32 * nb
    w = gguf_weight(rng, name, n, k, scales)
    x = rng.standard_normal(k).astype(np.float32) * np.float32(10.0 ** rng.uniform(-3, 3))
    with np.errstate(all="ignore"):
        got, want = run_int(x, w, nt, vw)
    check_close(got, want, x, w)


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("vw", [None, 8])
@pytest.mark.parametrize("name", INT_LAYOUTS)
def test_int_matvec_every_layout_width_and_path(name, vw, portable):
    """VNNI and the portable widening multiply, host width and 8; odd N; K
    with and without a tail of blocks; every byte value of a Q8_0 weight
    (-128 included); 1..3 threads; a zero block of x."""
    rng = np.random.default_rng(8)
    for n, k in ((7, 96), (33, 640), (5, 2048)):
        w = gguf_weight(rng, name, n, k, "normal")
        if name == "Q8_0":
            q = w.raw.reshape(-1, 34)
            q[:, 2:] = rng.integers(0, 256, size=q[:, 2:].shape, dtype=np.uint8)
            q[0, 2:] = 0x80
        x = rng.standard_normal(k).astype(np.float32)
        x[:32] = 0.0
        for nt in (1, 2, 3):
            got, want = run_int(x, w, nt, vw, portable)
            check_close(got, want, x, w)


@pytest.mark.parametrize("name", INT_LAYOUTS)
def test_int_matvec_long_rows(name):
    """K >= 8192: tiles of several rows share the x loads."""
    rng = np.random.default_rng(12)
    w = gguf_weight(rng, name, 9, 8192)
    x = rng.standard_normal(8192).astype(np.float32)
    got, want = run_int(x, w, 2)
    check_close(got, want, x, w)


@pytest.mark.parametrize("name", INT_LAYOUTS)
def test_int_matmul_prefill_rows(name):
    """[T, K] runs token by token (correct, not tuned)."""
    rng = np.random.default_rng(13)
    w = gguf_weight(rng, name, 11, 160)
    x = rng.standard_normal((5, 160)).astype(np.float32)
    for nt in (1, 3):
        got, want = run_int(x, w, nt)
        check_close(got, want, x, w)


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("name", INT_LAYOUTS)
def test_decode_rows_equal_one_row_calls_bit_for_bit(name, portable):
    """A batch of decode rows (``decode_rows``: quantize up to that many
    rows, then each weight tile against all of them, several rows sharing
    each unpacked weight block) gives every row exactly the one-row
    (decode) kernel's result: the same operations per row. T
    below, at and above decode_rows (groups), short and long rows, 1..3
    threads; the scratch holds decode_rows slots and no more."""
    rng = np.random.default_rng(21)
    for n, k in ((7, 96), (33, 640), (9, 8192)):
        w = gguf_weight(rng, name, n, k, "normal")
        one = compiled(sig_for("qmatmul", [TensorType((k,)), w.type], layout=name, act="q8"), portable=portable)
        for slots in (1, 3, 4, 8):
            sig = sig_for("qmatmul", [TensorType(("T", k)), w.type], layout=name, act="q8", decode_rows=slots)
            assert matmul.scratch_floats(sig) * 4 >= slots * k * 3
            rows = compiled(sig, portable=portable)
            for T in (1, 3, 4, 9, 13):
                x = rng.standard_normal((T, k)).astype(np.float32)
                for nt in (1, 3):
                    got = call_with_guard(rows, x, w, T, nt)
                    want = np.stack([call_with_guard(one, x[t], w, 1, nt) for t in range(T)])
                    np.testing.assert_array_equal(got, want)
                check_close(got, qmatmul_ref(x, w, layout=name, act="q8"), x, w)


def test_decode_rows_kernel_choice(tmp_path):
    """A positive int (the verifier says so); the interpreter computes such
    rows one at a time, as decode steps."""
    from ir.graph import Graph, WeightRef
    from ir.interp import WeightStore, run
    from ir.verify import VerifyError, verify

    rng = np.random.default_rng(22)
    w = gguf_weight(rng, "Q8_0", 5, 64)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    for act in ("q8", None):
        g = Graph("rows")
        xv = g.add_input("x", TensorType(("T", 64)))
        (tmp_path / "w.bin").write_bytes(np.asarray(w.raw).tobytes())
        wv = g.add_weight("w", w.type, WeightRef(str(tmp_path / "w.bin"), 0, w.type.nbytes()))
        attrs = {"layout": "Q8_0", **({"act": act} if act else {})}
        out = g.add_node("qmatmul", [xv, wv], attrs, kernel={"decode_rows": 4})
        assert out.type.shape == ("T", 5)
        g.set_outputs(out)
        verify(g)
        store = WeightStore()
        want = np.stack([qmatmul_ref(r, w, **attrs) for r in x])
        np.testing.assert_array_equal(run(g, {"x": x}, {}, store)[out.name], want)
        for bad in (0, 2.0, True):
            out.producer.kernel = {"decode_rows": bad}
            with pytest.raises(VerifyError, match="decode_rows"):
                verify(g)


def test_scratch_need():
    sig = sig_for("qmatmul", [TensorType((640,)), TensorType((8, 640), "f32", "Q5_0")], layout="Q5_0", act="q8")
    assert matmul.scratch_floats(sig) * 4 >= 640 * 3
    plain = sig_for("qmatmul", [TensorType((640,)), TensorType((8, 640), "f32", "Q5_0")], layout="Q5_0")
    assert matmul.scratch_floats(plain) == 0


@pytest.mark.parametrize("name", INT_LAYOUTS)
def test_vnni_in_assembly(name):
    if not host_target().int_dot:
        pytest.skip(f"host {host_target().cpu} has no VNNI")
    k = 2048
    sig = sig_for("qmatmul", [TensorType((k,)), TensorType((64, k), "f32", name)], layout=name, act="q8")
    asm = emit_assembly(compiled(sig).module)
    assert re.findall(r"\bvpdpbusd\s", asm), asm[:2000]


# --- the pass and whole models -----------------------------------------------------------------
def _tiny_model(tmp_path, qtype):
    from frontends.loader import load_model
    from test_gguf_frontend import tiny

    p, _ = tiny(tmp_path, qtype)
    return load_model(p)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_K", "F32"])
def test_pass_marks_qmatmuls_on_32_blocks(tmp_path, qtype):
    """Decode: the integer path, one row. Prefill: the integer path as a
    GEMM of GEMM_ROWS token rows (``gemm``). 32-value blocks get q8
    activations, the K-quants q8k (rows a multiple of 256); other layouts
    keep the float kernels."""
    from compiler.driver import model_graph
    from compiler.pipeline import run_pipeline
    from passes.int_dot import GEMM_ROWS

    m = _tiny_model(tmp_path, qtype)
    for mode in ("decode", "prefill"):
        g = run_pipeline(model_graph(m, mode, run_passes=False), ["fuse_dequant", "int_dot"])
        qm = [n for n in g.nodes if n.op == "qmatmul"]
        for n in qm:
            act = {**dict.fromkeys(INT_LAYOUTS, "q8"), "Q4_K": "q8k", "Q5_K": "q8k", "Q6_K": "q8k"}.get(
                n.attrs["layout"])
            if act == "q8k" and n.inputs[1].type.shape[1] % 256:
                act = None
            prompt = mode != "decode" and act is not None
            want = (act, None, GEMM_ROWS if prompt else None)
            assert (n.attrs.get("act"), n.kernel.get("decode_rows"), n.kernel.get("gemm")) == want, (mode, n.attrs)
        if qtype != "F32":
            assert any(n.attrs.get("act") for n in qm)


@pytest.mark.parametrize("qtype", ["Q8_0", "F32"])
def test_pass_marks_batch_graphs_of_decode_rows_only(tmp_path, qtype):
    """The batch graphs: in ``batch_decode`` (decode rows) every matmul gets
    ``decode_rows`` = max_batch and the Q8_0 ones the integer path;
    ``batch``/``batch_last`` (prompt chunks) are marked as prefill is (the
    GEMM). Without an integer matmul there is no batch_decode (it would be
    ``batch``), and then ``batch_sel`` (decode rows beside prompt rows)."""
    from compiler.driver import BatchOptions, CompileOptions, build_graphs
    from passes.int_dot import GEMM_ROWS

    m = _tiny_model(tmp_path, qtype)
    gs = build_graphs(m, CompileOptions(passes=("fuse_dequant", "int_dot"), batch=BatchOptions(4, 16, 3)))
    assert set(gs) == ({"batch", "batch_last", "batch_decode"} if qtype == "Q8_0"
                       else {"batch", "batch_last", "batch_sel"})
    for name, g in gs.items():
        mm = [n for n in g.nodes if n.op in ("matmul", "qmatmul")]
        for n in mm:
            if name == "batch_decode":
                want = ("q8" if n.op == "qmatmul" else None, 3, None)
            else:
                want = ("q8", None, GEMM_ROWS) if n.op == "qmatmul" and qtype == "Q8_0" else (None, None, None)
            assert (n.attrs.get("act"), n.kernel.get("decode_rows"), n.kernel.get("gemm")) == want, (name, n.attrs)
        assert mm, name
    gs = build_graphs(m, CompileOptions(passes=("fuse_dequant",), batch=BatchOptions(4, 16, 3)))
    assert set(gs) == {"batch", "batch_last", "batch_sel"}


def test_q8_0_model_interpreter_and_native_agree(tmp_path):
    """A synthetic Q8_0 GGUF with the pass in the pipeline: greedy decoding
    through the interpreter (numpy reference of the integer path) and
    through native code (the integer kernel, VNNI or the portable widening
    multiply) gives the same tokens."""
    import compiler.driver
    from test_gguf_frontend import tiny

    passes_ = ("fuse_dequant", "int_dot")
    p, _ = tiny(tmp_path, "Q8_0")
    g = compiler.driver.model_graph(compiler.driver.load_model(p), "decode",
                                    compiler.driver.CompileOptions(passes=passes_))
    assert sum(n.attrs.get("act") == "q8" for n in g.nodes) >= 7 * 2
    same_tokens_interp_and_native(p, passes_)


def test_default_pipeline_takes_the_integer_path_only_where_it_pays():
    from compiler.pipeline import DEFAULT_PIPELINE, default_pipeline

    assert default_pipeline("interp") == DEFAULT_PIPELINE
    assert ("int_dot" in default_pipeline("llvm")) == host_target().int_dot
