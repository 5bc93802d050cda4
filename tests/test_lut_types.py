"""GGUF's table types IQ4_NL, IQ4_XS and MXFP4 (4-bit indices into a
16-entry table): the numpy layouts (``ir/quant/lut.py``) bit for bit
against the ``gguf`` package (random bytes, extreme and special scales,
hand-made blocks, our quantizers' output), the integer reference
(``ir.int_dot``) against a slow formula from the stored bytes, and the
native kernels (``matmul/decode_lut``, ``matmul/int_lut``: the float path's
decode, prompt tiles and embedding; the integer path's decode, decode rows,
prompt chunks through the GEMM or its fallback; widths 4, 8, 16; VNNI,
portable and no byte shuffle at all; 1..3 threads) against the references;
and a synthetic model of each type through the interpreter and native code.
Agreement with llama.cpp is ``test_families``'s."""
from __future__ import annotations

import re

import numpy as np
import pytest
from gguf import quants as gq
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

import passes.int_dot  # noqa: F401  (registers the pass)
from compiler.codegen.harness import CompiledKernel, run_kernel_like_reference, sig_for
from compiler.codegen.jit import emit_assembly
from compiler.codegen.matmul.gemm import use_gemm
from compiler.codegen.simd import pshufb
from compiler.codegen.target import host_target, vnni_width
from ir.int_dot import int_act, int_blocks, quantize_q8_rows
from ir.ops import ShapeError, WeightData, embedding_ref, get_op, qmatmul_ref
from ir.quant import get_layout, quant_type
from ir.quant.lut import KVALUES_IQ4NL, KVALUES_MXFP4
from ir.types import TensorType
from kernel_checks import activations, call_with_guard, check_dot, portable_target, run_embedding, run_qmatmul
from test_gguf_layouts import EXTREME_F16, SPECIAL_F16
from test_int_qsf import check_both
from test_int_dot import check_close

LUT = ["IQ4_NL", "IQ4_XS", "MXFP4"]
#: MXFP4 exponent bytes: "normal" scales 2^-13 .. 2^7; "extreme" the subnormal
#: ones (e < 2), 1 and far from it but with finite dot products; "special"
#: also those whose largest values overflow float32 (e >= 253)
MXFP4_EXTREME = np.array([0, 1, 2, 3, 20, 100, 127, 128, 150, 160], np.uint8)
MXFP4_SPECIAL = np.array([253, 254, 255], np.uint8)
_KERNELS: dict = {}


# --- operands -----------------------------------------------------------------------------------------
def random_blocks(rng: np.random.Generator, name: str, nblocks: int, scales: str) -> np.ndarray:
    """uint8 [nblocks, block_bytes]: random indices (and IQ4_XS sub-block
    scales); the block scale ``normal``, ``extreme``, ``special`` (above) or
    random ``bytes``."""
    lay = get_layout(name)
    raw = rng.integers(0, 256, size=(nblocks, lay.block_bytes), dtype=np.uint8)
    if scales == "bytes":
        return raw
    if name == "MXFP4":
        e = {"normal": rng.integers(115, 136, nblocks),
             "extreme": rng.choice(MXFP4_EXTREME, nblocks),
             "special": rng.choice(np.concatenate([MXFP4_EXTREME, MXFP4_SPECIAL]), nblocks)}[scales]
        raw[:, 0] = e
        return raw
    if scales == "normal":
        f = rng.uniform(1e-3, 0.1, nblocks) * rng.choice([-1.0, 1.0], nblocks)
    elif scales == "extreme":
        f = rng.choice(EXTREME_F16, nblocks)
    else:
        f = rng.choice(np.concatenate([EXTREME_F16, SPECIAL_F16]), nblocks)
    raw[:, 0:2] = np.asarray(f, "<f2").view(np.uint8).reshape(nblocks, 2)
    return raw


def lut_weight(rng: np.random.Generator, name: str, n: int, k: int, scales: str = "normal") -> WeightData:
    """A [n, k] weight of random blocks (``random_blocks``)."""
    t = TensorType((n, k), "f32", name)
    lay = get_layout(name)
    return WeightData(random_blocks(rng, name, lay.nbytes(t.shape) // lay.block_bytes, scales).reshape(-1), t)


def quantized_weight(rng: np.random.Generator, name: str, n: int, k: int) -> WeightData:
    """A [n, k] weight made by the layout's quantizer from Gaussian rows, with
    a zero block, a constant block and a wide-range row."""
    m = rng.standard_normal((n, k)).astype(np.float32)
    m[0, :256] = 0.0
    m[-1, -256:] = 0.75
    m[n // 2] *= np.float32(300.0)
    return WeightData(get_layout(name).quantize(m), TensorType((n, k), "f32", name))


def gguf_dequant(raw: np.ndarray, name: str, n: int) -> np.ndarray:
    with np.errstate(all="ignore"):
        return gq.dequantize(np.asarray(raw).reshape(n, -1), GGMLQuantizationType[name])


def shapes(name: str) -> tuple[tuple[int, int], ...]:
    """(rows, K): odd rows; K with a tail after the unrolled steps, and without."""
    if get_layout(name).block == 256:
        return (7, 256), (13, 768), (5, 2048)
    return (7, 96), (13, 640), (5, 2048)


# --- the numpy layouts ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", LUT)
def test_rows_match_gguf(name):
    qt = quant_type(name)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    assert (qt.block, qt.block_bytes, qt.ggml_type) == (block, size, GGMLQuantizationType[name].value)
    lay = get_layout(name)
    assert lay.nbytes((3, 4 * block)) == 3 * 4 * size
    with pytest.raises(ValueError):
        lay.nbytes((2, block + 16))


def test_tables_are_ggmls():
    """The one definition of each table (``ir/quant/lut.py``) is ggml's, as gguf-py has it."""
    assert KVALUES_IQ4NL == tuple(gq.IQ4_NL.kvalues) and get_layout("IQ4_NL").kvalues == KVALUES_IQ4NL
    assert KVALUES_MXFP4 == tuple(gq.MXFP4.kvalues) and get_layout("MXFP4").kvalues == KVALUES_MXFP4
    assert get_layout("IQ4_XS").kvalues == KVALUES_IQ4NL


@pytest.mark.parametrize("scales", ["bytes", "normal", "extreme", "special"])
@pytest.mark.parametrize("name", LUT)
def test_dequantize_matches_gguf(name, scales):
    """Bit for bit (nan and inf where gguf has them), whole tensors and picked rows."""
    rng = np.random.default_rng(sum(map(ord, name + scales)))
    lay = get_layout(name)
    n, k = 37, 4 * lay.block
    w = lut_weight(rng, name, n, k, scales)
    want = gguf_dequant(w.raw, name, n)
    with np.errstate(all="ignore"):
        got = lay.dequantize(w.raw, (n, k))
        rows = rng.integers(0, n, size=(4, 3))
        picked = lay.dequantize_rows(w.raw, (n, k), rows)
    assert got.dtype == np.float32 and got.shape == (n, k)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(picked, want[rows])


def _pairs(idx: np.ndarray) -> np.ndarray:
    return (idx[:16] | (idx[16:] << 4)).astype(np.uint8)


#: distinct low and high nibbles
IDX = (np.arange(32) * 7) % 16


def test_iq4_nl_block_fields():
    """A hand-made block: which bytes are the scale and which nibble is which value (d = 0.5)."""
    idx = IDX
    blk = np.concatenate([np.frombuffer(np.float16(0.5).tobytes(), np.uint8), _pairs(idx)])
    want = 0.5 * np.array(KVALUES_IQ4NL, np.float32)[idx]
    np.testing.assert_array_equal(get_layout("IQ4_NL").dequantize(blk, (1, 32))[0], want)
    np.testing.assert_array_equal(gguf_dequant(blk, "IQ4_NL", 1)[0], want)


def test_iq4_xs_block_fields():
    """A hand-made block: d = 0.25, sub-block s has scale ls[s] (low 4 bits:
    nibble s % 2 of scales_l[s // 2]; high 2: bits 2s, 2s+1 of scales_h) and
    the indices rolled by s."""
    idx = IDX
    ls = [0, 1, 17, 31, 32, 45, 62, 63]
    scales_h = sum((v >> 4) << (2 * s) for s, v in enumerate(ls))
    scales_l = [(ls[2 * i] & 15) | ((ls[2 * i + 1] & 15) << 4) for i in range(4)]
    qs = np.concatenate([_pairs(np.roll(idx, s)) for s in range(8)])
    blk = np.concatenate([np.frombuffer(np.float16(0.25).tobytes(), np.uint8),
                          np.frombuffer(np.uint16(scales_h).tobytes(), np.uint8), np.array(scales_l, np.uint8), qs])
    assert blk.size == 136
    want = np.concatenate([0.25 * (ls[s] - 32) * np.array(KVALUES_IQ4NL, np.float32)[np.roll(idx, s)]
                           for s in range(8)])
    np.testing.assert_array_equal(get_layout("IQ4_XS").dequantize(blk, (1, 256))[0], want)
    np.testing.assert_array_equal(gguf_dequant(blk, "IQ4_XS", 1)[0], want)


def test_mxfp4_block_fields():
    """Hand-made blocks: e = 130 is 2^2 (the table's doubled values halved);
    e = 0 and 1 are the subnormal 2^-128, 2^-127."""
    idx = IDX
    for e, scale in ((130, 4.0), (0, 2.0 ** -128), (1, 2.0 ** -127), (128, 1.0)):
        blk = np.concatenate([np.array([e], np.uint8), _pairs(idx)])
        want = (np.float32(scale) * np.array(KVALUES_MXFP4, np.float32)[idx]).astype(np.float32)
        np.testing.assert_array_equal(get_layout("MXFP4").dequantize(blk, (1, 32))[0], want)
        np.testing.assert_array_equal(gguf_dequant(blk, "MXFP4", 1)[0], want)


def _rel_rms(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(((a.astype(np.float64) - b) ** 2).mean() / (b.astype(np.float64) ** 2).mean()))


@pytest.mark.parametrize("name", LUT)
def test_quantize_round_trip(name):
    """Our quantizers' bytes read by gguf as by us; zero and constant blocks
    come back (to float16 rounding of the scale); the error on Gaussian rows
    of wide-ranging scales is below Q4_0's (4.5 bits a value too, gguf's
    quantizer) for the IQ4 types; MXFP4's bytes are gguf's."""
    rng = np.random.default_rng(11)
    n, k = 24, 512
    data = rng.standard_normal((n, k)).astype(np.float32) * (10.0 ** rng.uniform(-2, 3, (n, 1))).astype(np.float32)
    data[0] = 0.0
    data[1] = 3.25
    data[2, ::2] = -1e-3
    lay = get_layout(name)
    raw = lay.quantize(data)
    assert raw.dtype == np.uint8 and raw.size == lay.nbytes((n, k))
    got = lay.dequantize(raw, (n, k))
    np.testing.assert_array_equal(got, gguf_dequant(raw, name, n))
    assert np.all(got[0] == 0)
    if name == "MXFP4":
        np.testing.assert_array_equal(raw, gq.quantize(data, GGMLQuantizationType.MXFP4).reshape(-1))
        assert np.all(got[1] == 3.0)            # 3.25 is between 3 and 4: the nearest of the doubled E2M1 grid
        return
    np.testing.assert_allclose(got[1], 3.25, rtol=2.0 ** -10)
    q4 = gq.dequantize(gq.quantize(data[3:], GGMLQuantizationType.Q4_0), GGMLQuantizationType.Q4_0)
    assert _rel_rms(got[3:], data[3:]) < 0.95 * _rel_rms(q4, data[3:]), (_rel_rms(got[3:], data[3:]),
                                                                         _rel_rms(q4, data[3:]))


@pytest.mark.parametrize("name", LUT)
def test_quantize_refuses_non_finite_values(name):
    x = np.zeros((2, 256), np.float32)
    x[1, 7] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        get_layout(name).quantize(x)


@pytest.mark.parametrize("name", LUT)
def test_int_blocks_are_the_dequantized_values(name):
    """d_w * q in float32, as ggml's dequantizers compute it, is the layout's dequantization."""
    w = lut_weight(np.random.default_rng(5), name, 6, 512, "extreme")
    d, q, m = int_blocks(w)
    assert m is None and q.dtype == np.int8 and q.shape == (6, 16, 32) and d.shape == (6, 16)
    with np.errstate(all="ignore"):
        v = d[:, :, None] * q.astype(np.float32)
    np.testing.assert_array_equal(v.reshape(6, 512), w.to_f32())


def slow_block(name: str, blk: bytes) -> list[tuple[float, list[int]]]:
    """(d_w, 32 integer quants) of each 32-value block of one stored block, bit by bit."""
    def f16(p: bytes) -> float:
        return float(np.frombuffer(p, "<f2")[0])

    def quants(qs: bytes, table) -> list[int]:
        return [table[qs[j] & 15] for j in range(16)] + [table[qs[j] >> 4] for j in range(16)]

    if name == "IQ4_NL":
        return [(f16(blk[0:2]), quants(blk[2:18], KVALUES_IQ4NL))]
    if name == "MXFP4":
        return [(2.0 ** (blk[0] - 128), quants(blk[1:17], KVALUES_MXFP4))]
    d, sh, sl = f16(blk[0:2]), int.from_bytes(blk[2:4], "little"), int.from_bytes(blk[4:8], "little")
    return [(d * ((((sl >> 4 * s) & 15) | (((sh >> 2 * s) & 3) << 4)) - 32),
             quants(blk[8 + 16 * s:24 + 16 * s], KVALUES_IQ4NL)) for s in range(8)]


@pytest.mark.parametrize("name", LUT)
def test_reference_matches_slow_formula(name):
    rng = np.random.default_rng(3)
    n, k = 5, 512
    w = lut_weight(rng, name, n, k)
    x = rng.standard_normal(k).astype(np.float32) * np.float32(3.0)
    x[32:64] = 0.0                                               # a zero activation block
    lay = get_layout(name)
    bb, per_row = lay.block_bytes, k // lay.block
    raw = bytes(np.asarray(w.raw, np.uint8))
    dx, qx = quantize_q8_rows(x[None])
    want = []
    for r in range(n):
        parts = [p for o in range(r * per_row * bb, (r + 1) * per_row * bb, bb)
                 for p in slow_block(name, raw[o:o + bb])]
        want.append(sum(dw * float(dx[0, b]) * sum(a * int(c) for a, c in zip(q, qx[0, b]))
                        for b, (dw, q) in enumerate(parts)))
    got = qmatmul_ref(x, w, layout=name, act="q8")
    np.testing.assert_allclose(got, np.array(want, np.float32), rtol=1e-6, atol=1e-6)


def test_shape_rule_takes_lut_types():
    for name in LUT:
        assert int_act(name) == "q8"
        wt = TensorType((8, 512), "f32", name)
        assert get_op("qmatmul").infer([TensorType((512,)), wt], {"layout": name, "act": "q8"}).shape == (8,)
        with pytest.raises(ShapeError):
            get_op("qmatmul").infer([TensorType((512,)), wt], {"layout": name, "act": "q8k"})


# --- the float path ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("vw", [None, 8, 4])
@pytest.mark.parametrize("t", [None, 7])
@pytest.mark.parametrize("name", LUT)
def test_qmatmul_every_layout_and_width(name, t, vw):
    """Decode and prefill, host width (16: the permute tables) / 8 / 4, 1..3 threads."""
    rng = np.random.default_rng(5)
    for n, k in shapes(name)[:2]:
        w = lut_weight(rng, name, n, k, "extreme")
        x = activations(rng, t, k)
        for nt in (1, 2, 3):
            got, want = run_qmatmul(x, w, nt, vw)
            check_dot(got, want, x, w)


@pytest.mark.parametrize("name", LUT)
def test_qmatmul_long_rows_and_k_chunks(name):
    """Decode with K >= 8192 (4-row tiles), prefill with K cut into chunks."""
    rng = np.random.default_rng(9)
    for n, k, t in ((5, 8192, None), (3, 2304, 6)):
        w = lut_weight(rng, name, n, k)
        x = activations(rng, t, k)
        got, want = run_qmatmul(x, w, 2)
        check_dot(got, want, x, w)


@pytest.mark.parametrize("vw", [None, 8, 4])
@pytest.mark.parametrize("scales", ["normal", "extreme", "special", "bytes"])
@pytest.mark.parametrize("name", LUT)
def test_embedding(name, scales, vw):
    """Rows decoded with the reference's own float32 operations: bit-exact, nan and inf included."""
    rng = np.random.default_rng(len(name) + len(scales))
    w = lut_weight(rng, name, 13, 512, scales)
    for ids in (np.int32(5), rng.integers(0, 13, size=6).astype(np.int32)):
        for nt in (1, 3):
            got = run_embedding(w, ids, nt, vw)
            with np.errstate(all="ignore"):
                want = embedding_ref(w, ids)
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def _asm(sig, vw=None, target=None) -> str:
    return emit_assembly(CompiledKernel(sig, vector_width=vw, target=target).module)


@pytest.mark.parametrize("name", LUT)
def test_float_path_instructions(name):
    """AVX-512: each lane's weight from the block's table of 16 (vpermps), no
    conversions; at width 8 the indices become table values by vpshufb."""
    target = host_target()
    k = 4096
    sig = sig_for("qmatmul", [TensorType((k,)), TensorType((64, k), "f32", name)], layout=name)
    if target.has("avx512f") and target.vector_width == 16:
        asm = _asm(sig)
        assert len(re.findall(r"\bvperm[it]?2?\w*\s[^\n]*%zmm", asm)) >= 8, asm[:3000]
        assert not re.findall(r"\bvcvtdq2ps\s[^\n]*%zmm", asm)
    if target.has("ssse3"):
        assert re.findall(r"\bv?pshufb\s", _asm(sig, 8))


# --- the integer path ----------------------------------------------------------------------------------------
def kernel(sig, vw=None, portable=False) -> CompiledKernel:
    key = (sig, vw, portable)
    if key not in _KERNELS:
        _KERNELS[key] = CompiledKernel(sig, vector_width=vw, target=portable_target(vw) if portable else None)
    return _KERNELS[key]


def sig_of(w: WeightData, rows: int | str | None = None, **attrs):
    k = int(w.type.shape[1])
    xt = TensorType((k,) if rows is None else (rows, k))
    return sig_for("qmatmul", [xt, w.type], layout=w.type.layout, act="q8", **attrs)


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("vw", [4, 8, 16])
@pytest.mark.parametrize("name", LUT)
def test_decode_kernel(name, vw, portable):
    """One token: every shape, 1..3 threads, against the q8 reference and
    (quantized weights) the float path; random bytes with extreme scales
    against the q8 reference."""
    rng = np.random.default_rng(8)
    for n, k in shapes(name):
        x = rng.standard_normal(k).astype(np.float32)
        x[:32] = 0.0
        w = quantized_weight(rng, name, n, k)
        wx = lut_weight(rng, name, n, k, "extreme")
        for nt in (1, 2, 3):
            check_both(call_with_guard(kernel(sig_of(w), vw, portable), x, w, 1, nt), x, w)
            with np.errstate(all="ignore"):
                check_close(call_with_guard(kernel(sig_of(wx), vw, portable), x, wx, 1, nt),
                            qmatmul_ref(x, wx, layout=name, act="q8"), x, wx)


@pytest.mark.parametrize("name", LUT)
def test_long_rows_take_multi_row_tiles(name):
    rng = np.random.default_rng(12)
    w = quantized_weight(rng, name, 9, 8192)
    x = rng.standard_normal(8192).astype(np.float32)
    check_both(call_with_guard(kernel(sig_of(w)), x, w, 1, 2), x, w)


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("vw", [8, 16])
@pytest.mark.parametrize("name", LUT)
def test_decode_rows_equal_one_row_calls_bit_for_bit(name, vw, portable):
    """A batch of decode rows gives each row the decode step's bits (T below,
    at and above ``decode_rows``; 1 and 3 threads)."""
    rng = np.random.default_rng(21)
    for n, k in ((7, 256), (33, 768)):
        w = quantized_weight(rng, name, n, k)
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


@pytest.mark.parametrize("vw", [4, 8, 16])
@pytest.mark.parametrize("name", LUT)
def test_prompt_chunks(name, vw):
    """Prompt chunks (``gemm``): the GEMM where the rows fill its tiles (48
    rows), the decode kernel's fallback elsewhere (37 rows, or no VNNI at
    this width); each token row's bits do not depend on the chunk."""
    rng = np.random.default_rng(31)
    for n, took in ((48, vnni_width(vw) is not None), (37, False)):
        w = quantized_weight(rng, name, n, 512)
        sig = sig_of(w, "T", gemm=64)
        assert use_gemm(sig, vw) == took
        x = rng.standard_normal((17, 512)).astype(np.float32)
        for nt in (1, 2, 3):
            got = call_with_guard(kernel(sig, vw), x, w, 17, nt)
            check_both(got, x, w)
        np.testing.assert_array_equal(call_with_guard(kernel(sig, vw), x[5:9], w, 4, 2), got[5:9])


@pytest.mark.parametrize("name", LUT)
def test_int_instructions(name):
    """VNNI dot products fed by vpshufb lookups."""
    if not host_target().int_dot:
        pytest.skip(f"host {host_target().cpu} has no VNNI")
    asm = _asm(sig_for("qmatmul", [TensorType((2048,)), TensorType((64, 2048), "f32", name)], layout=name, act="q8"))
    ops = set(re.findall(r"^\s+([a-z][a-z0-9]*)\b", asm, re.M))
    assert {"vpdpbusd", "vpshufb"} <= ops, sorted(ops)


def no_byte_shuffle_target():
    """The host without SSSE3 and everything above it (AVX, FMA ...): no
    ``pshufb``, so the lookups take their portable select tree."""
    host = host_target()
    if not host.triple.startswith("x86_64"):
        return host
    return host.variant(host.cpu, ("ssse3", "sse4", "avx", "fma", "f16c", "gfni", "vaes", "vpclmulqdq", "sha",
                                   "amx", "xop", "kl", "widekl", "aes", "pclmul", "sm3", "sm4"))


@pytest.mark.parametrize("name", LUT)
def test_without_byte_shuffles(name):
    """Float path (decode, prefill, embedding) and integer path (decode,
    decode rows) where the target has no pshufb at all."""
    target = no_byte_shuffle_target()
    assert pshufb(target, 16) is None and pshufb(target, 32) is None
    rng = np.random.default_rng(41)
    n, k = shapes(name)[1]
    w = quantized_weight(rng, name, n, k)
    for vw in (4, 8):
        for t in (None, 5):
            x = activations(rng, t, k)
            xt = TensorType((k,) if t is None else ("T", k))
            sig = sig_for("qmatmul", [xt, w.type], layout=name)
            kern = CompiledKernel(sig, vector_width=vw, target=target)
            got = call_with_guard(kern, x, w, t or 1, 2)
            check_dot(got, qmatmul_ref(x, w, layout=name), x, w)
            assert not re.findall(r"\bv?pshufb\s", emit_assembly(kern.module))
        ids = np.array([0, n - 1, 3], np.int32)
        esig = sig_for("embedding", [w.type, TensorType(("T",), "i32")])
        out = run_kernel_like_reference(esig, [w, ids], nthreads=2, symbols={"T": 3},
                                        kernel=CompiledKernel(esig, vector_width=vw, target=target))
        np.testing.assert_array_equal(out, embedding_ref(w, ids))
        x = rng.standard_normal((3, k)).astype(np.float32)
        one = CompiledKernel(sig_of(w), vector_width=vw, target=target)
        rows = CompiledKernel(sig_of(w, "T", decode_rows=2), vector_width=vw, target=target)
        got = call_with_guard(rows, x, w, 3, 2)
        np.testing.assert_array_equal(got, np.stack([call_with_guard(one, r, w, 1, 2) for r in x]))
        check_both(got, x, w)
        assert not re.findall(r"\bv?pshufb\s", emit_assembly(one.module))


# --- a whole model ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("qtype", LUT)
def test_synthetic_gguf_native_and_interpreter_agree(tmp_path, qtype):
    """A synthetic llama GGUF written in the type (``frontends.gguf_writer``)
    loads with every matrix in it; native code on the float path equals the
    interpreter to float32 rounding; with the default pipeline (the integer
    path where the host has VNNI) the pass marks every qmatmul, and the
    interpreter running the same passes (the q8 reference) gives the same
    greedy tokens."""
    import runtime
    from compiler.driver import CompileOptions, load_model, model_graph
    from compiler.pipeline import DEFAULT_PIPELINE
    from test_gguf_frontend import tiny

    p, _ = tiny(tmp_path, qtype)
    m = load_model(p)
    assert {w.type.layout for name, w in m.weights.items() if len(w.type.shape) == 2} == {qtype}
    g = model_graph(m, "decode", CompileOptions(passes=("fuse_dequant", "int_dot")))
    qm = [n for n in g.nodes if n.op == "qmatmul"]
    assert qm and all(n.attrs.get("act") == "q8" for n in qm)
    ids = [1, 5, 77, 260, 9, 42]
    ref = runtime.load(p, backend="interp")
    a = ref.logits(ids)
    b = runtime.load(p, backend="llvm", threads=2, passes=DEFAULT_PIPELINE).logits(ids)
    assert np.abs(a - b).max() <= 1e-4 * max(1.0, float(np.abs(a).max()))
    passes_ = ("fuse_dequant", "int_dot")
    want = list(runtime.load(p, backend="interp", passes=passes_).generate(ids, 8, temperature=0.0))
    got = list(runtime.load(p, backend="llvm", threads=2, use_cache=False, passes=passes_).generate(ids, 8,
                                                                                                    temperature=0.0))
    assert got == want


def test_writer_falls_back_to_iq4_nl_for_short_rows():
    """As llama.cpp's quantizer: IQ4_XS needs rows of a multiple of 256 values, IQ4_NL takes the others."""
    from frontends.gguf_writer import tensor_qtype

    assert tensor_qtype((300, 512), "IQ4_XS") == "IQ4_XS"
    assert tensor_qtype((300, 96), "IQ4_XS") == "IQ4_NL"
    assert tensor_qtype((96,), "IQ4_XS") == "F32"
