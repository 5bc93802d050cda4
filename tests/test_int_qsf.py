"""The integer path (``act="q8"``) on QSF's block types: the reference
(``ir.int_dot``, ``ir.ops.qmatmul_ref``) against a slow formula written
from the stored bytes, the native kernels (``matmul/int_qsf``: decode,
``decode_rows`` batches, prompt chunks through the GEMM or its fallback;
VNNI / vpsadbw and the portable code; vector widths 4, 8, 16; 1..3
threads) against the reference and the float path, the pass, and converted
stories260K models through the runtime."""
from __future__ import annotations

import re

import numpy as np
import pytest

import passes.int_dot  # noqa: F401  (registers the pass)
from compiler.codegen.harness import CompiledKernel, sig_for
from compiler.codegen.jit import emit_assembly
from compiler.codegen.matmul.gemm import use_gemm
from compiler.codegen.target import host_target, vnni_width
from ir.quant import get_layout
from ir.int_dot import int_act, int_blocks, quantize_q8_rows
from ir.ops import ShapeError, WeightData, get_op, qmatmul_ref
from ir.types import TensorType
from kernel_checks import call_with_guard, portable_target
from shared_data import MODELS, needs_shared
from test_int_dot import check_close

QSF_INT = ["QSF_Q8", "QSF_Q4", "QSF_Q2", "QSF_Q2S", "QSF_TERNARY"]
#: (rows, K): rows not a multiple of any tile, K = 1, 3, 10 and 32 blocks of 64
SHAPES = ((7, 64), (13, 192), (33, 640), (5, 2048))
WIDTHS = [4, 8, 16]
_KERNELS: dict = {}


def qsf_weight(rng, name: str, n: int, k: int) -> WeightData:
    """A [n, k] weight quantized by the layout's own quantizer, with a zero
    row block, a constant block and a wide-range row (scales far apart)."""
    m = rng.standard_normal((n, k)).astype(np.float32)
    m[0, :64] = 0.0
    m[-1, -64:] = 0.75
    m[n // 2] *= np.float32(300.0)
    return WeightData(get_layout(name).quantize(m), TensorType((n, k), "f32", name))


def kernel(sig, vw=None, portable=False) -> CompiledKernel:
    """Compiled once per test session; ``portable`` for the host without
    vpdpbusd and vpsadbw."""
    key = (sig, vw, portable)
    if key not in _KERNELS:
        _KERNELS[key] = CompiledKernel(sig, vector_width=vw, target=portable_target(vw) if portable else None)
    return _KERNELS[key]


def sig_of(w: WeightData, rows: int | str | None = None, **attrs):
    k = int(w.type.shape[1])
    xt = TensorType((k,) if rows is None else (rows, k))
    return sig_for("qmatmul", [xt, w.type], layout=w.type.layout, act="q8", **attrs)


def quant_tolerance(x: np.ndarray, w: WeightData) -> np.ndarray:
    """How far the integer path may be from the float one: per block of 32,
    |q_x d_x - x| <= amax (1/254 + 2^-11) (rounding to an int8 level, d_x
    rounded to float16), times sum |w| over the block, plus float32 rounding."""
    k = int(w.type.shape[1])
    xb = np.asarray(x, np.float64).reshape(-1, k // 32, 32)
    amax = np.abs(xb).max(axis=2)                                     # [M, nb]
    wabs = np.abs(w.to_f32().astype(np.float64)).reshape(-1, k // 32, 32).sum(axis=2)   # [N, nb]
    bound = amax @ wabs.T * (1 / 254 + 2.0 ** -10)
    scale = np.abs(np.asarray(x, np.float64).reshape(-1, k)) @ np.abs(w.to_f32().astype(np.float64)).T
    return (bound + 1e-5 * scale).reshape(np.shape(x)[:-1] + (int(w.type.shape[0]),))


def check_both(got, x, w) -> None:
    """The q8 reference to float32 rounding of the epilogue, and the float path within quantization."""
    check_close(got, qmatmul_ref(x, w, layout=w.type.layout, act="q8"), x, w)
    flt = qmatmul_ref(x, w, layout=w.type.layout)
    assert np.all(np.abs(got.astype(np.float64) - flt) <= quant_tolerance(x, w))


# --- the reference --------------------------------------------------------------------------------
def _f16(b: bytes) -> float:
    return float(np.frombuffer(b, "<f2")[0])


def slow_values(name: str, blk: bytes) -> tuple[float, float, list[int]]:
    """(d, m, 64 integer quants) of one stored block, bit by bit: value = d q + m."""
    d = _f16(blk[0:2])
    if name == "QSF_Q8":
        return d, 0.0, [v - 256 if v >= 128 else v for v in blk[2:66]]
    if name == "QSF_Q4":
        qs = blk[4:36]
        return d, -_f16(blk[2:4]) * d, [qs[i] & 15 for i in range(32)] + [qs[i] >> 4 for i in range(32)]
    if name in ("QSF_Q2", "QSF_Q2S"):
        at = 4 if name == "QSF_Q2" else 2
        q = [(blk[at + i % 16] >> (2 * (i // 16))) & 3 for i in range(64)]
        return d, (_f16(blk[2:4]) if name == "QSF_Q2" else -1.5 * d), q
    sign, zero = int.from_bytes(blk[2:10], "little"), int.from_bytes(blk[10:18], "little")
    return d, 0.0, [0 if zero >> j & 1 else (-1 if sign >> j & 1 else 1) for j in range(64)]


def slow_int_matvec(x: np.ndarray, w: WeightData) -> np.ndarray:
    """Python ints per 32-value half, float64 (here: Python floats) outside."""
    name, (n, k) = w.type.layout, (int(s) for s in w.type.shape)
    bb = get_layout(name).block_bytes
    raw = bytes(np.asarray(w.raw, np.uint8))
    dx, qx = quantize_q8_rows(x[None])
    out = []
    for r in range(n):
        total = 0.0
        for b in range(k // 64):
            o = (r * (k // 64) + b) * bb
            d, m, q = slow_values(name, raw[o:o + bb])
            for h in range(2):
                xb = [int(v) for v in qx[0, 2 * b + h]]
                xd = float(dx[0, 2 * b + h])
                total += d * xd * sum(a * c for a, c in zip(q[32 * h:32 * h + 32], xb)) + m * xd * sum(xb)
        out.append(total)
    return np.array(out)


@pytest.mark.parametrize("name", QSF_INT)
def test_reference_matches_slow_formula(name):
    rng = np.random.default_rng(3)
    w = qsf_weight(rng, name, 5, 192)
    x = rng.standard_normal(192).astype(np.float32) * np.float32(3.0)
    x[32:64] = 0.0                                              # a zero activation block in a weight block's half
    got = qmatmul_ref(x, w, layout=name, act="q8")
    np.testing.assert_allclose(got, slow_int_matvec(x, w).astype(np.float32), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", QSF_INT)
def test_int_blocks_are_the_dequantized_values(name):
    """d q + m, exact in float64, is the layout's float32 dequantization to one rounding."""
    w = qsf_weight(np.random.default_rng(5), name, 6, 128)
    d, q, m = int_blocks(w)
    assert q.dtype == np.int8 and q.shape == (6, 4, 32) and d.shape == (6, 4)
    assert (m is None) == (name in ("QSF_Q8", "QSF_TERNARY"))
    np.testing.assert_array_equal(d[:, 0::2], d[:, 1::2])       # two halves share a block's d
    v = d[:, :, None].astype(np.float64) * q + (0 if m is None else m[:, :, None].astype(np.float64))
    f = w.to_f32()
    assert np.all(np.abs(v.reshape(6, 128) - f) <= np.abs(f) * 2.0 ** -24)


def test_shape_rule_and_pass_take_qsf_layouts():
    for name in QSF_INT:
        assert int_act(name) == "q8"
        wt = TensorType((8, 128), "f32", name)
        assert get_op("qmatmul").infer([TensorType((128,)), wt], {"layout": name, "act": "q8"}).shape == (8,)
        with pytest.raises(ShapeError):
            get_op("qmatmul").infer([TensorType((128,)), wt], {"layout": name, "act": "q8k"})


# --- the kernels ------------------------------------------------------------------------------------
@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("vw", WIDTHS)
@pytest.mark.parametrize("name", QSF_INT)
def test_decode_kernel(name, vw, portable):
    """One token: every shape, 1..3 threads, against the q8 reference and the float path."""
    rng = np.random.default_rng(8)
    for n, k in SHAPES:
        w = qsf_weight(rng, name, n, k)
        x = rng.standard_normal(k).astype(np.float32)
        x[:32] = 0.0
        for nt in (1, 2, 3):
            check_both(call_with_guard(kernel(sig_of(w), vw, portable), x, w, 1, nt), x, w)


@pytest.mark.parametrize("name", QSF_INT)
def test_long_rows_take_multi_row_tiles(name):
    rng = np.random.default_rng(12)
    w = qsf_weight(rng, name, 9, 8192)
    x = rng.standard_normal(8192).astype(np.float32)
    check_both(call_with_guard(kernel(sig_of(w)), x, w, 1, 2), x, w)


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("vw", [8, 16])
@pytest.mark.parametrize("name", QSF_INT)
def test_decode_rows_equal_one_row_calls_bit_for_bit(name, vw, portable):
    """A batch of decode rows gives each row the decode step's bits (T below,
    at and above ``decode_rows``; 1 and 3 threads)."""
    rng = np.random.default_rng(21)
    for n, k in ((7, 128), (33, 640)):
        w = qsf_weight(rng, name, n, k)
        one = kernel(sig_of(w), vw, portable)
        for slots in (1, 3, 4):
            rows = kernel(sig_of(w, "T", decode_rows=slots), vw, portable)
            for T in (1, 3, 5):
                x = rng.standard_normal((T, k)).astype(np.float32)
                for nt in (1, 3):
                    got = call_with_guard(rows, x, w, T, nt)
                    want = np.stack([call_with_guard(one, x[t], w, 1, nt) for t in range(T)])
                    np.testing.assert_array_equal(got, want)
                check_both(got, x, w)


@pytest.mark.parametrize("vw", WIDTHS)
@pytest.mark.parametrize("name", QSF_INT)
def test_prompt_chunks(name, vw):
    """Prompt chunks (``gemm``): the GEMM where the rows fill its tiles
    (48 rows), the decode kernel's fallback elsewhere (37 rows, or no VNNI at
    this width); each token row's bits do not depend on the chunk."""
    rng = np.random.default_rng(31)
    for n, took in ((48, vnni_width(vw) is not None), (37, False)):
        w = qsf_weight(rng, name, n, 256)
        sig = sig_of(w, "T", gemm=64)
        assert use_gemm(sig, vw) == took
        x = rng.standard_normal((17, 256)).astype(np.float32)
        for nt in (1, 2, 3):
            got = call_with_guard(kernel(sig, vw), x, w, 17, nt)
            check_both(got, x, w)
        np.testing.assert_array_equal(call_with_guard(kernel(sig, vw), x[5:9], w, 4, 2), got[5:9])


def _instructions(name: str, vw=None) -> set[str]:
    k = 2048
    sig = sig_for("qmatmul", [TensorType((k,)), TensorType((64, k), "f32", name)], layout=name, act="q8")
    asm = emit_assembly(kernel(sig, vw).module)
    return set(re.findall(r"^\s+([a-z][a-z0-9]*)\b", asm, re.M))


@pytest.mark.parametrize("name", QSF_INT)
def test_instructions(name):
    """VNNI for the quant types; ternary adds bytes (vpsadbw) and has no
    integer multiply at all."""
    if not host_target().int_dot:
        pytest.skip(f"host {host_target().cpu} has no VNNI")
    ops = _instructions(name)
    if name != "QSF_TERNARY":
        assert "vpdpbusd" in ops, sorted(ops)
        return
    assert "vpsadbw" in ops, sorted(ops)
    assert not {o for o in ops if re.match(r"v?p(mul|madd|dpb|dpw)", o)}, sorted(ops)


# --- the pass and whole models -----------------------------------------------------------------
def _convert(qtype: str, tmp_path_factory) -> str:
    if not MODELS.is_dir():
        pytest.skip("../shared (models and references) is absent")
    from frontends.convert import convert

    out = str(tmp_path_factory.mktemp("qsfint") / f"stories260K-{qtype}.qsf")
    convert(str(MODELS / "stories260K.bin"), out, qtype, tokenizer=str(MODELS / "tok512.bin"))
    return out


INT_PASSES = ("fuse_dequant", "int_dot")


@needs_shared
@pytest.mark.parametrize("qtype", ["q8", "q4", "q2", "ternary"])
def test_converted_model_on_the_integer_path(qtype, tmp_path_factory):
    """A converted stories260K: the pass marks every QSF qmatmul (decode:
    q8, prompt: the GEMM); native code with the pass equals the interpreter
    with it (the q8 reference) to float32 rounding; and the integer path
    stays near the float path: logits within 3% of their range (x rounded
    to 8 bits per block of 32: ~0.4% per activation, over a few layers), and
    the same greedy tokens where the float path's choice is decisive."""
    import runtime
    from compiler.driver import CompileOptions, load_model, model_graph
    from compiler.pipeline import DEFAULT_PIPELINE, default_pipeline
    from passes.int_dot import GEMM_ROWS

    path = _convert(qtype, tmp_path_factory)
    m = load_model(path)
    for mode in ("decode", "prefill"):
        g = model_graph(m, mode, CompileOptions(passes=INT_PASSES))
        qm = [n for n in g.nodes if n.op == "qmatmul" and n.attrs["layout"].startswith("QSF_")]
        assert qm
        for n in qm:
            assert n.attrs.get("act") == "q8" and n.kernel.get("gemm") == (GEMM_ROWS if mode == "prefill" else None)
    ids = [1, 365, 143, 31, 367, 263, 120, 42, 7, 260]
    li = runtime.load(path, backend="interp", passes=INT_PASSES).logits(ids)
    ln = runtime.load(path, backend="llvm", threads=2, use_cache=False, passes=INT_PASSES).logits(ids)
    assert np.abs(li - ln).max() <= 1e-4 * np.abs(li).max()
    flt = runtime.load(path, backend="llvm", threads=2, passes=DEFAULT_PIPELINE)
    lf = flt.logits(ids)
    assert np.abs(ln - lf).max() <= 0.03 * (lf.max() - lf.min())
    if host_target().int_dot:
        assert "int_dot" in default_pipeline("llvm")
    nat = runtime.load(path, backend="llvm", threads=2)          # the default pipeline
    got = list(nat.generate(ids[:4], 24, temperature=0.0))
    want = list(flt.generate(ids[:4], 24, temperature=0.0))
    seq = ids[:4] + want
    logits = flt.logits(seq)
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:           # allowed only where the float path's top two are close
            top = np.sort(logits[3 + i])[-2:]
            assert top[1] - top[0] <= 0.03 * (logits[3 + i].max() - logits[3 + i].min()), (i, got, want)
            break
