"""GGUF's ternary types TQ1_0 and TQ2_0 (BitNet b1.58 files).

The table rows against the ``gguf`` package's sizes and ids; the numpy
dequantizers (``ir/quant/ternary.py``) bit for bit against
``gguf.quants.dequantize`` and against a slow per-value formula written
from ggml's packing (the value order, base-3 digits packed as ggml's
quantizer packs them); the integer view and the q8k reference against a
slow formula in Python ints; the native kernels
(``compiler/codegen/matmul/ternary.py``): the float path (qmatmul decode
and prefill, long rows and K chunks, embedding bit for bit) and the
integer path (VNNI and portable, widths 4/8/16, 1..3 threads, decode rows
bit for bit, long rows, prompt chunks through the GEMM); the ``int_dot``
pass and a synthetic model, interpreter against native code. Agreement
with llama.cpp on whole models: ``test_families.py``."""
from __future__ import annotations

import re
import struct

import gguf.quants as gq
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

import passes.int_dot  # noqa: F401  (registers the pass)
from compiler.codegen import matmul
from compiler.codegen.harness import CompiledKernel, sig_for
from compiler.codegen.jit import emit_assembly
from compiler.codegen.matmul import float_tiles
from compiler.codegen.matmul.gemm import use_gemm
from compiler.codegen.matmul.traits import traits_of
from compiler.codegen.target import host_target, vnni_width
from ir.int_dot import int_act, kquant_ints, quantize_q8k_rows
from ir.ops import ShapeError, WeightData, embedding_ref, get_op, qmatmul_ref
from ir.quant import get_layout, quant_type, repackable
from ir.types import TensorType
from kernel_checks import (activations, call_with_guard, check_dot, check_within, portable_target, run_embedding,
                           run_qmatmul, same_tokens_interp_and_native)
from test_int_kquants import slow_quantize

LAYOUTS = ["TQ1_0", "TQ2_0"]
QK = 256
EXTREME_F16 = np.array([65504.0, -65504.0, 2.0 ** -14, -(2.0 ** -14), 2.0 ** -24, -(2.0 ** -24), 0.0, -0.0,
                        1.0, -3.5, 1000.0], dtype=np.float16)
SPECIAL_F16 = np.array([np.inf, -np.inf, np.nan], dtype=np.float16)


# --- operands -------------------------------------------------------------------------------------
def random_blocks(rng: np.random.Generator, name: str, nblocks: int, scales: str) -> np.ndarray:
    """uint8 [nblocks, block_bytes]: random code bytes (TQ2_0: code 3
    included), d ``normal`` (|d| in 1e-3..0.1, both signs), ``extreme``,
    ``special`` (extremes, inf, nan) or ``bytes`` (random bits)."""
    lay = get_layout(name)
    raw = rng.integers(0, 256, size=(nblocks, lay.block_bytes), dtype=np.uint8)
    if scales == "bytes":
        return raw
    if scales == "normal":
        d = rng.uniform(1e-3, 0.1, nblocks) * rng.choice([-1.0, 1.0], nblocks)
    elif scales == "extreme":
        d = rng.choice(EXTREME_F16, nblocks)
    elif scales == "special":
        d = rng.choice(np.concatenate([EXTREME_F16, SPECIAL_F16]), nblocks)
    else:
        raise ValueError(scales)
    at = lay.at("d")
    raw[:, at:at + 2] = np.asarray(d, "<f2").view(np.uint8).reshape(nblocks, 2)
    return raw


def tq_weight(rng, name: str, n: int, k: int, scales: str = "normal") -> WeightData:
    t = TensorType((n, k), "f32", name)
    return WeightData(random_blocks(rng, name, n * k // QK, scales).reshape(-1), t)


def quantized_weight(rng, name: str, n: int, k: int) -> WeightData:
    """A [n, k] Gaussian weight through ``gguf.quants.quantize`` (codes 0..2,
    d = max |x|), rows of different scales."""
    m = rng.standard_normal((n, k)).astype(np.float32) * (10.0 ** rng.uniform(-2, 1, (n, 1))).astype(np.float32)
    return WeightData(gq.quantize(m, GGMLQuantizationType[name]).reshape(-1), TensorType((n, k), "f32", name))


def bits(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


# --- ggml's format, a value at a time ----------------------------------------------------------------
def slow_code(name: str, blk: bytes, v: int) -> int:
    """The code (0..2; TQ2_0 0..3) of value v of one block, as ggml's
    ``dequantize_row_tq1_0`` / ``_tq2_0`` walk the bytes."""
    if name == "TQ2_0":
        h, r = divmod(v, 128)
        l, m = divmod(r, 32)
        return (blk[32 * h + m] >> (2 * l)) & 3
    if v < 160:
        n, m = divmod(v, 32)
        byte = blk[m]
    elif v < 240:
        n, m = divmod(v - 160, 16)
        byte = blk[32 + m]
    else:
        n, j = divmod(v - 240, 4)
        byte = blk[48 + j]
    return ((byte * 3 ** n) % 256 * 3) >> 8


def slow_value(name: str, blk: bytes, v: int) -> np.float32:
    d = np.float32(struct.unpack_from("<e", blk, 52 if name == "TQ1_0" else 64)[0])
    return np.float32(slow_code(name, blk, v) - 1) * d


def ggml_pack_tq1(codes: list[int]) -> bytes:
    """256 codes 0..2 -> the 52 code bytes of a TQ1_0 block, as ggml's
    quantizer packs them: the digits of a byte most significant first, the
    byte ceil(N * 256 / 243) of their base-3 number N (qh: four digits, N
    times 3)."""
    def byte(ds: list[int], scale: int = 1) -> int:
        n = 0
        for c in ds:
            n = n * 3 + c
        return (n * scale * 256 + 242) // 243

    qs0 = [byte([codes[32 * n + m] for n in range(5)]) for m in range(32)]
    qs1 = [byte([codes[160 + 16 * n + m] for n in range(5)]) for m in range(16)]
    qh = [byte([codes[240 + 4 * n + j] for n in range(4)], 3) for j in range(4)]
    return bytes(qs0 + qs1 + qh)


# --- the table rows and the numpy layouts ------------------------------------------------------------
@pytest.mark.parametrize("name", LAYOUTS)
def test_table_rows(name):
    qt, lay = quant_type(name), get_layout(name)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    assert (qt.block, qt.block_bytes, qt.ggml_type) == (block, size, int(GGMLQuantizationType[name]))
    assert (lay.name, lay.block, lay.block_bytes) == (name, block, size)
    assert (qt.zero, qt.sub_block, qt.act, qt.offset, qt.tile_bytes) == (1, 256, "q8k", False, None)
    assert qt.at("d") == size - 2 and qt.at("qs") == 0
    assert (qt.has("qh"), qt.at("qh") if qt.has("qh") else None) == ((True, 48) if name == "TQ1_0" else (False, None))
    assert lay.nbytes((3, 512)) == 3 * 2 * size
    with pytest.raises(ValueError):
        lay.nbytes((2, 384))
    assert name not in repackable() and int_act(name) == "q8k"
    tr = traits_of(name)
    assert tr.decoder and tr.int_kernel and tr.gemm and not tr.repacked


@pytest.mark.parametrize("scales", ["bytes", "normal", "extreme", "special"])
@pytest.mark.parametrize("name", LAYOUTS)
def test_dequantize_matches_gguf(name, scales):
    """Bit for bit (zeros' signs included; nan where gguf has nan), whole tensors and picked rows."""
    rng = np.random.default_rng(sum(map(ord, name + scales)))
    n, k = 37, 1024
    w = tq_weight(rng, name, n, k, scales)
    lay = get_layout(name)
    with np.errstate(all="ignore"):
        want = gq.dequantize(w.raw.reshape(n, -1), GGMLQuantizationType[name])
        got = lay.dequantize(w.raw, (n, k))
        rows = rng.integers(0, n, size=(4, 3))
        picked = lay.dequantize_rows(w.raw, (n, k), rows)
    assert got.dtype == np.float32 and got.shape == (n, k)
    np.testing.assert_array_equal(bits(got), bits(want))
    np.testing.assert_array_equal(bits(picked), bits(want[rows]))


@pytest.mark.parametrize("name", LAYOUTS)
def test_value_order_is_ggml_s(name):
    """Every value of random blocks (every byte value in every code byte)
    from the slow per-value formula, and codes packed as ggml packs them
    read back in their places."""
    rng = np.random.default_rng(2)
    lay = get_layout(name)
    blocks = random_blocks(rng, name, 40, "normal")
    blocks[:, :lay.at("d")][:8] = np.arange(8 * lay.at("d")).reshape(8, -1) % 256   # every byte value
    got = lay.dequant_blocks(blocks)
    for i, blk in enumerate(blocks):
        want = [slow_value(name, bytes(blk), v) for v in range(QK)]
        np.testing.assert_array_equal(bits(got[i]), bits(np.array(want, np.float32)))
    for _ in range(20):
        codes = [int(c) for c in rng.integers(0, 3, QK)]
        blk = np.zeros(lay.block_bytes, np.uint8)
        if name == "TQ1_0":
            blk[:52] = np.frombuffer(ggml_pack_tq1(codes), np.uint8)
        else:
            c = np.array(codes, np.uint8).reshape(2, 4, 32)
            blk[:64] = (c[:, 0] | c[:, 1] << 2 | c[:, 2] << 4 | c[:, 3] << 6).reshape(64)
        blk[lay.at("d"):] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)
        np.testing.assert_array_equal(lay.dequant_blocks(blk[None])[0], (np.array(codes) - 1) * np.float32(0.5))


@pytest.mark.parametrize("name", LAYOUTS)
def test_round_trip_gguf_quantize(name):
    """gguf.quants.quantize output: read as gguf reads it, and within half a
    step (d = max |x| of the super-block, rounded to float16) of the data."""
    rng = np.random.default_rng(11)
    n, k = 24, 512
    data = rng.standard_normal((n, k)).astype(np.float32) * (10.0 ** rng.uniform(-2, 3, (n, 1))).astype(np.float32)
    data[0] = 0.0
    data[1] = 3.25
    data[2, ::2] = -1e-3
    raw = gq.quantize(data, GGMLQuantizationType[name])
    lay = get_layout(name)
    assert raw.dtype == np.uint8 and raw.size == lay.nbytes((n, k))
    got = lay.dequantize(raw.reshape(-1), (n, k))
    np.testing.assert_array_equal(bits(got), bits(gq.dequantize(raw, GGMLQuantizationType[name])))
    codes = lay.codes(raw.reshape(-1, lay.block_bytes))
    assert codes.max() <= 2
    amax = np.abs(data.reshape(-1, QK)).max(axis=1, keepdims=True)
    assert np.all(np.abs(got.reshape(-1, QK) - data.reshape(-1, QK)) <= amax * (0.5 + 1e-3))
    np.testing.assert_array_equal(got[1], np.float32(3.25))


def test_writer_falls_back_as_llama_cpp():
    """Rows not a multiple of 256 values are written as Q4_0, as llama.cpp's quantizer does."""
    from frontends.gguf_writer import tensor_qtype

    for name in LAYOUTS:
        assert tensor_qtype((300, 512), name) == name
        assert tensor_qtype((300, 192), name) == "Q4_0"
        assert tensor_qtype((512,), name) == "F32"


# --- the integer path's reference -----------------------------------------------------------------------
def slow_int_matvec(x: np.ndarray, w: WeightData) -> np.ndarray:
    """ggml_vec_dot_tq*_q8_K in Python ints: per super-block sum (c - 1) q_x, times d_w d_x."""
    name, (n, k) = w.type.layout, (int(s) for s in w.type.shape)
    bb = get_layout(name).block_bytes
    raw = bytes(np.asarray(w.raw, np.uint8))
    xq = [slow_quantize(x[i * QK:(i + 1) * QK]) for i in range(k // QK)]
    out = []
    for r in range(n):
        total = 0.0
        for i, (dx, qx) in enumerate(xq):
            blk = raw[(r * (k // QK) + i) * bb:(r * (k // QK) + i + 1) * bb]
            d = struct.unpack_from("<e", blk, bb - 2)[0]
            total += d * dx * sum((slow_code(name, blk, v) - 1) * qx[v] for v in range(QK))
        out.append(total)
    return np.array(out)


@pytest.mark.parametrize("name", LAYOUTS)
def test_reference_matches_slow_formula(name):
    rng = np.random.default_rng(3)
    w = tq_weight(rng, name, 4, 1024)
    x = rng.standard_normal(1024).astype(np.float32) * np.float32(3.0)
    x[256:512] = 0.0                                                    # a zero block: d_x = 0
    got = qmatmul_ref(x, w, layout=name, act="q8k")
    np.testing.assert_allclose(got, slow_int_matvec(x, w).astype(np.float32), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", LAYOUTS)
def test_integer_view_is_the_dequantized_values(name):
    """One sub-block of scale 1, no minimum; d q is the dequantization, bit for bit."""
    w = tq_weight(np.random.default_rng(5), name, 3, 512, "extreme")
    wi = kquant_ints(w)
    assert wi.sc.shape == (3, 2, 1) and np.all(wi.sc == 1) and wi.m is None and wi.dmin is None
    assert wi.q.min() >= -1 and wi.q.max() <= (1 if name == "TQ1_0" else 2)
    v = (wi.d[:, :, None] * wi.q.astype(np.float32)).reshape(3, 512)
    np.testing.assert_array_equal(bits(v), bits(w.to_f32()))


def test_shape_rule_and_pass_take_ternary_layouts():
    for name in LAYOUTS:
        wt = TensorType((8, 512), "f32", name)
        assert get_op("qmatmul").infer([TensorType((512,)), wt], {"layout": name, "act": "q8k"}).shape == (8,)
        with pytest.raises(ShapeError):
            get_op("qmatmul").infer([TensorType((512,)), wt], {"layout": name, "act": "q8"})


# --- the float path --------------------------------------------------------------------------------------
@pytest.mark.parametrize("t", [None, 5], ids=["decode", "prefill"])
@pytest.mark.parametrize("vw", [4, 8, 16])
@pytest.mark.parametrize("name", LAYOUTS)
def test_qmatmul(name, vw, t):
    """Odd rows, one to nine super-blocks, 1..3 threads, random and quantized weights."""
    rng = np.random.default_rng(5)
    for n, k, scales in ((7, 256, "extreme"), (13, 1280, "normal"), (3, 2304, "normal")):
        for w in (tq_weight(rng, name, n, k, scales), quantized_weight(rng, name, n, k)):
            x = activations(rng, t, k)
            for nt in (1, 2, 3):
                got, want = run_qmatmul(x, w, nt, vw)
                check_dot(got, want, x, w)


@pytest.mark.parametrize("name", LAYOUTS)
def test_qmatmul_long_rows_and_k_chunks(name):
    """Decode with K >= 8192 (4-row tiles) and prefill with K cut into chunks
    (the default 1024, and 256: one super-block a chunk)."""
    rng = np.random.default_rng(9)
    for n, k, t, chunk in ((5, 8192, None, float_tiles.K_CHUNK), (3, 2304, 6, float_tiles.K_CHUNK), (3, 2304, 6, 256)):
        w = tq_weight(rng, name, n, k)
        x = activations(rng, t, k)
        saved, float_tiles.K_CHUNK = float_tiles.K_CHUNK, chunk
        try:
            got, want = run_qmatmul(x, w, 2)
        finally:
            float_tiles.K_CHUNK = saved
        check_dot(got, want, x, w)


@pytest.mark.parametrize("scales", ["normal", "extreme", "special", "bytes"])
@pytest.mark.parametrize("vw", [4, 8, 16])
@pytest.mark.parametrize("name", LAYOUTS)
def test_embedding(name, vw, scales):
    """Rows decoded with the reference's float32 operations: bit for bit,
    zeros' signs, inf and nan included."""
    rng = np.random.default_rng(len(scales) + vw)
    w = tq_weight(rng, name, 11, 768, scales)
    for ids in (np.int32(rng.integers(0, 11)), rng.integers(0, 11, size=(7,)).astype(np.int32)):
        for nt in (1, 3):
            got = run_embedding(w, ids, nt, vw)
            with np.errstate(all="ignore"):
                want = embedding_ref(w, ids)
            np.testing.assert_array_equal(got, want)
            ok = ~np.isnan(want)
            np.testing.assert_array_equal(bits(got[ok]), bits(want[ok]))


# --- the integer path -----------------------------------------------------------------------------------
_KERNELS: dict = {}


def kernel(sig, vw=None, portable=False) -> CompiledKernel:
    """Compiled once per session; ``portable`` for the host without the x86 multiply-adds."""
    key = (sig, vw, portable)
    if key not in _KERNELS:
        _KERNELS[key] = CompiledKernel(sig, vector_width=vw, target=portable_target(vw) if portable else None)
    return _KERNELS[key]


def sig_of(w: WeightData, rows: str | None = None, **attrs):
    k = int(w.type.shape[1])
    xt = TensorType((k,) if rows is None else (rows, k))
    return sig_for("qmatmul", [xt, w.type], layout=w.type.layout, act="q8k", **attrs)


def check_both(got: np.ndarray, x: np.ndarray, w: WeightData) -> None:
    """The q8k reference up to the float epilogue's rounding (relative to the
    size of the terms: |d_w d_x| (|c| + 1) |q_x|, the kernel adds c q_x and
    -q_x), and the float path within the rounding of x to its Q8_K quants
    (half a step per value, times |w|)."""
    k = int(w.type.shape[1])
    xr = np.asarray(x, np.float32).reshape(-1, k)
    dx, qx, _ = quantize_q8k_rows(xr)
    wi = kquant_ints(w)
    terms = np.einsum("nbv,mbv->mnb", np.abs(wi.q.astype(np.float64) + 1) + 1, np.abs(qx.astype(np.float64)))
    size = np.einsum("mnb,nb,mb->mn", terms, np.abs(wi.d.astype(np.float64)), np.abs(dx.astype(np.float64)))
    lead = np.shape(x)[:-1] + (int(w.type.shape[0]),)
    check_within(got, qmatmul_ref(x, w, layout=w.type.layout, act="q8k"), size.reshape(lead))
    wf = np.abs(w.to_f32().astype(np.float64))
    half_step = np.repeat(dx.astype(np.float64), QK, axis=1) / 2
    bound = (half_step @ wf.T * (1 + 1e-4) + 1e-5 * (np.abs(xr.astype(np.float64)) @ wf.T)).reshape(lead)
    flt = qmatmul_ref(x, w, layout=w.type.layout)
    assert np.all(np.abs(got.astype(np.float64) - flt) <= bound)


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("vw", [4, 8, 16])
@pytest.mark.parametrize("name", LAYOUTS)
def test_int_kernel_every_width_and_path(name, vw, portable):
    """One token: odd rows, one to nine super-blocks, a zero block of x, 1..3 threads."""
    rng = np.random.default_rng(8)
    for n, k in ((7, 256), (33, 1024), (5, 2304)):
        for w in (tq_weight(rng, name, n, k), quantized_weight(rng, name, n, k)):
            x = rng.standard_normal(k).astype(np.float32)
            if k > 256:
                x[256:512] = 0.0
            for nt in (1, 2, 3):
                check_both(call_with_guard(kernel(sig_of(w), vw, portable), x, w, 1, nt), x, w)


@pytest.mark.parametrize("name", LAYOUTS)
def test_int_long_rows_take_multi_row_tiles(name):
    rng = np.random.default_rng(12)
    w = tq_weight(rng, name, 9, 8192)
    x = rng.standard_normal(8192).astype(np.float32)
    check_both(call_with_guard(kernel(sig_of(w)), x, w, 1, 2), x, w)


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("vw", [8, 16])
@pytest.mark.parametrize("name", LAYOUTS)
def test_decode_rows_equal_one_row_calls_bit_for_bit(name, vw, portable):
    """A batch of decode rows gives each row the decode step's bits (T below,
    at and above ``decode_rows``; 1 and 3 threads); the scratch rule holds."""
    rng = np.random.default_rng(21)
    for n, k in ((7, 256), (33, 1280)):
        w = tq_weight(rng, name, n, k)
        one = kernel(sig_of(w), vw, portable)
        for slots in (1, 3, 8):
            sig = sig_of(w, "T", decode_rows=slots)
            assert matmul.scratch_floats(sig) * 4 >= slots * k
            rows = kernel(sig, vw, portable)
            for T in (1, 3, 9):
                x = rng.standard_normal((T, k)).astype(np.float32)
                for nt in (1, 3):
                    got = call_with_guard(rows, x, w, T, nt)
                    want = np.stack([call_with_guard(one, x[t], w, 1, nt) for t in range(T)])
                    np.testing.assert_array_equal(bits(got), bits(want))
                check_both(got, x, w)


@pytest.mark.parametrize("vw", [4, 8, 16])
@pytest.mark.parametrize("name", LAYOUTS)
def test_prompt_chunks(name, vw):
    """Prompt chunks (``gemm``): the K-quant GEMM where the rows fill its
    tiles (48 rows; K of one and five super-blocks: a K chunk and a tail),
    the decode kernel's fallback elsewhere (37 rows, or no VNNI at this
    width); each token row's bits do not depend on the chunk."""
    rng = np.random.default_rng(31)
    for n, k, took in ((48, 256, vnni_width(vw) is not None), (48, 1280, vnni_width(vw) is not None),
                       (37, 256, False)):
        w = tq_weight(rng, name, n, k)
        sig = sig_of(w, "T", gemm=64)
        assert use_gemm(sig, vw) == took
        x = rng.standard_normal((70, k)).astype(np.float32)
        x[3, :256] = 0.0
        for T in (1, 7, 17, 70):
            for nt in (1, 2, 3):
                got = call_with_guard(kernel(sig, vw), x[:T], w, T, nt)
                check_both(got, x[:T], w)
        np.testing.assert_array_equal(bits(call_with_guard(kernel(sig, vw), x[5:9], w, 4, 2)), bits(got[5:9]))


@pytest.mark.parametrize("name", LAYOUTS)
def test_vnni_products(name):
    """With VNNI the products are ``vpdpbusd`` of the codes (four 512-bit
    ones per super-block and row), not the K-quants' ``vpmaddubsw`` and
    ``vpdpwssd`` by scales; TQ2_0's decoding has no multiply at all."""
    t = host_target()
    if not (t.int_dot and t.has("avx512vnni")):
        pytest.skip(f"host {t.cpu} has no AVX-512 VNNI")
    k = 2048
    sig = sig_for("qmatmul", [TensorType((k,)), TensorType((64, k), "f32", name)], layout=name, act="q8k")
    asm = emit_assembly(kernel(sig, 16).module)
    assert len(re.findall(r"\bvpdpbusd\s[^\n]*%zmm", asm)) == 4, asm[:3000]
    assert len(re.findall(r"\bvpdpwssd\s", asm)) <= 1          # the seed -sum q_x, where LLVM keeps it fused
    if name == "TQ2_0":
        assert not re.findall(r"\bv?p(mul|madd)\w*\s", asm)


# --- the pass and a whole model ---------------------------------------------------------------------------
@pytest.mark.parametrize("qtype", LAYOUTS)
def test_ternary_model_interpreter_and_native_agree(tmp_path, qtype):
    """A synthetic GGUF in the type (``write_gguf``, ``gguf.quants``), the
    int_dot pass in the pipeline: every matmul on its weights takes the q8k
    path (prompt chunks the GEMM); the prompt's logits through the
    interpreter and through native code agree to float rounding, and so do
    the greedy tokens, the prompt through prefill."""
    import compiler.driver
    import runtime
    from test_gguf_frontend import tiny

    passes_ = ("fuse_dequant", "int_dot")
    p, _ = tiny(tmp_path, qtype)
    model = compiler.driver.load_model(p)
    assert model.weights["blk.0.ffn_down"].type.layout == qtype
    assert model.weights["token_embd"].type.layout == qtype
    for mode in ("decode", "prefill"):
        g = compiler.driver.model_graph(model, mode, compiler.driver.CompileOptions(passes=passes_))
        mms = [n for n in g.nodes if n.op == "qmatmul" and n.attrs["layout"] == qtype]
        assert mms and all(n.attrs.get("act") == "q8k" for n in mms), mode
        assert all(("gemm" in n.kernel) == (mode == "prefill") for n in mms), mode
    ids = [1, 200, 3, 77, 260, 9, 42, 5] * 3
    ref = runtime.load(p, backend="interp", passes=passes_).logits(ids)
    nat = runtime.load(p, backend="llvm", threads=2, use_cache=False, passes=passes_).logits(ids)
    assert np.shape(nat) == (len(ids), 300)
    assert np.abs(np.asarray(nat) - ref).max() <= 1e-5 * np.abs(ref).max()
    same_tokens_interp_and_native(p, passes_)
