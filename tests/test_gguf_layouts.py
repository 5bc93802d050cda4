"""GGUF's simple block quant types (BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1).

The numpy dequantizers in ``ir/quant/gguf.py`` are checked bit for bit
against the ``gguf`` package (llama.cpp's own Python reference) on random
bytes, extreme float16 scales and ``gguf.quants.quantize`` output; the
native kernels (``compiler/codegen/matmul/decode_gguf.py``) against the op
references, called once per thread id as the step function would."""
from __future__ import annotations

import re

import numpy as np
import pytest
from gguf import quants as gq
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compiler.codegen.matmul import float_tiles
from compiler.codegen.harness import sig_for
from compiler.codegen.jit import emit_assembly
from compiler.codegen.target import host_target
from ir.quant import BlockLayout, get_layout
from ir.ops import WeightData, embedding_ref
from ir.types import TensorType
from kernel_checks import activations, check_dot, check_long_rows_and_k_chunks, compiled, run_embedding, run_qmatmul

LAYOUTS = ["BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
QTYPES = LAYOUTS[1:]
#: byte offsets of a block's float16 fields: the scale d, and the offset m of the _1 types
F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q5_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2)}

F16_MIN_NORMAL = 2.0 ** -14
F16_MIN_SUBNORMAL = 2.0 ** -24
#: finite extremes: the largest float16, the smallest normal and subnormals, zeros, signs
EXTREME_F16 = np.array([65504.0, -65504.0, F16_MIN_NORMAL, -F16_MIN_NORMAL, F16_MIN_SUBNORMAL,
                        -F16_MIN_SUBNORMAL, 1023 * F16_MIN_SUBNORMAL, 0.0, -0.0, 1.0, -3.5, 1000.0],
                       dtype=np.float16)
SPECIAL_F16 = np.array([np.inf, -np.inf, np.nan], dtype=np.float16)

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- operands -----------------------------------------------------------------------------
def random_blocks(rng: np.random.Generator, name: str, nblocks: int, scales: str) -> np.ndarray:
    """uint8 [nblocks, block_bytes]: random quants, and scales (offsets) that are
    ``normal`` (|d| in 1e-3..0.1), ``extreme`` (finite float16 extremes),
    ``special`` (extremes, inf and nan) or ``bytes`` (random bits)."""
    lay = get_layout(name)
    assert isinstance(lay, BlockLayout)
    raw = rng.integers(0, 256, size=(nblocks, lay.block_bytes), dtype=np.uint8)
    if name == "BF16":
        if scales == "bytes":
            return raw
        if scales == "normal":
            v = rng.standard_normal(nblocks).astype(np.float32)
        else:  # bfloat16 subnormals to 2^100 (dot products stay finite), zeros, inf/nan for "special"
            v = (2.0 ** rng.uniform(-140, 100, nblocks) * rng.choice([-1.0, 1.0], nblocks)).astype(np.float32)
            v[rng.random(nblocks) < 0.1] = 0.0
            if scales == "special":
                v[rng.random(nblocks) < 0.1] = rng.choice([np.inf, -np.inf, np.nan])
        return (v.view(np.uint32) >> 16).astype("<u2").view(np.uint8).reshape(nblocks, 2)
    if scales == "bytes":
        return raw
    for off in F16_FIELDS[name]:
        if scales == "normal":
            f = rng.uniform(1e-3, 0.1, nblocks) * rng.choice([-1.0, 1.0], nblocks)
        elif scales == "extreme":
            f = rng.choice(EXTREME_F16, nblocks)
        elif scales == "special":
            f = rng.choice(np.concatenate([EXTREME_F16, SPECIAL_F16]), nblocks)
        else:
            raise ValueError(scales)
        raw[:, off:off + 2] = np.asarray(f, "<f2").view(np.uint8).reshape(nblocks, 2)
    return raw


def gguf_weight(rng: np.random.Generator, name: str, n: int, k: int, scales: str = "normal") -> WeightData:
    lay = get_layout(name)
    t = TensorType((n, k), "f32", name)
    nblocks = lay.nbytes(t.shape) // lay.block_bytes
    raw = random_blocks(rng, name, nblocks, scales).reshape(-1)
    return WeightData(raw, t)


def gguf_dequant(raw: np.ndarray, name: str, n: int) -> np.ndarray:
    with np.errstate(all="ignore"):
        return gq.dequantize(raw.reshape(n, -1), GGMLQuantizationType[name])


# --- the numpy dequantizers -------------------------------------------------------------------
@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_sizes_match_gguf(name):
    lay = get_layout(name)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    assert (lay.name, lay.block, lay.block_bytes) == (name, block, size)
    assert lay.nbytes((3, 4 * block)) == 3 * 4 * size
    if block > 1:
        with pytest.raises(ValueError):
            lay.nbytes((2, block + 1))


@pytest.mark.parametrize("scales", ["bytes", "normal", "extreme", "special"])
@pytest.mark.parametrize("name", LAYOUTS)
def test_dequantize_matches_gguf(name, scales):
    """Bit for bit (nan where gguf has nan), whole tensors and picked rows."""
    rng = np.random.default_rng(sum(map(ord, name + scales)))
    lay = get_layout(name)
    n, k = 37, 8 * lay.block if lay.block > 1 else 301
    w = gguf_weight(rng, name, n, k, scales)
    want = gguf_dequant(w.raw, name, n)
    with np.errstate(all="ignore"):
        got = lay.dequantize(w.raw, (n, k))
        rows = rng.integers(0, n, size=(4, 3))
        picked = lay.dequantize_rows(w.raw, (n, k), rows)
    assert got.dtype == np.float32 and got.shape == (n, k)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(picked, want[rows])


@pytest.mark.parametrize("name", QTYPES)
def test_block_field_order(name):
    """One hand-made block per type: which bytes are the scale, the offset,
    the high bits, and which nibble is which value."""
    lay = get_layout(name)
    blk = np.zeros(lay.block_bytes, np.uint8)
    d, m = np.float16(0.5), np.float16(-2.0)
    blk[0:2] = np.frombuffer(d.tobytes(), np.uint8)
    q = np.arange(32) % 16 if name != "Q8_0" else np.arange(32) - 16
    hb = np.zeros(32, np.int64)
    if name == "Q8_0":
        blk[2:] = q.astype(np.int8).view(np.uint8)
    else:
        qs = 4 if name == "Q4_1" else 6 if name == "Q5_0" else 8 if name == "Q5_1" else 2
        q = (np.arange(32) * 7) % 16  # distinct low/high nibbles
        blk[qs:qs + 16] = q[:16] | (q[16:] << 4)
        if name in ("Q4_1", "Q5_1"):
            blk[2:4] = np.frombuffer(m.tobytes(), np.uint8)
        if name.startswith("Q5"):
            hb = (np.arange(32) % 3 == 0).astype(np.int64)
            qh = int((hb << np.arange(32)).sum())
            at = 2 if name == "Q5_0" else 4
            blk[at:at + 4] = np.frombuffer(np.uint32(qh).tobytes(), np.uint8)
    value = {"Q8_0": q * 0.5, "Q4_0": (q - 8) * 0.5, "Q4_1": q * 0.5 - 2.0,
             "Q5_0": (q + 16 * hb - 16) * 0.5, "Q5_1": (q + 16 * hb) * 0.5 - 2.0}[name]
    got = lay.dequantize(blk, (1, 32))[0]
    np.testing.assert_array_equal(got, value.astype(np.float32))
    np.testing.assert_array_equal(got, gguf_dequant(blk, name, 1)[0])


#: worst-case round-trip error of gguf's quantizers, as a multiple of each
#: block's max |x| (Q4_0/Q5_0 clip the most negative level: one full step)
_ROUND_TRIP_ERR = {"Q8_0": 0.6 / 127, "Q4_0": 1.0 / 8, "Q5_0": 1.0 / 16,
                   "Q4_1": 2 * 0.6 / 15, "Q5_1": 2 * 0.6 / 31}


@pytest.mark.parametrize("name", LAYOUTS)
def test_round_trip_gguf_quantize(name):
    """gguf.quants.quantize output: we read it exactly as gguf does, and it is
    the data it was made from up to the format's quantization error."""
    rng = np.random.default_rng(11)
    n, k = 24, 256
    data = rng.standard_normal((n, k)).astype(np.float32) * (10.0 ** rng.uniform(-2, 3, (n, 1))).astype(np.float32)
    data[0] = 0.0
    data[1] = 3.25
    data[2, ::2] = -1e-3
    data[3] += 50.0  # offsets for the _1 types
    raw = gq.quantize(data, GGMLQuantizationType[name])
    lay = get_layout(name)
    assert raw.dtype == np.uint8 and raw.size == lay.nbytes((n, k))
    got = lay.dequantize(raw.reshape(-1), (n, k))
    np.testing.assert_array_equal(got, gguf_dequant(raw, name, n))
    if name == "BF16":
        np.testing.assert_allclose(got, data, rtol=2.0 ** -8, atol=0)
        return
    blocks = data.reshape(-1, 32)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    err = np.abs(got.reshape(-1, 32) - blocks)
    assert np.all(err <= amax * (_ROUND_TRIP_ERR[name] + 2e-3)), err.max()


# --- native qmatmul ------------------------------------------------------------------------------
tokens = st.one_of(st.none(), st.integers(1, 9))   # None: decode (x is [K])
odd_n = st.sampled_from([1, 3, 5, 7, 13, 33])
block_k = st.sampled_from([32, 64, 96, 160, 256, 352, 512])


@settings(max_examples=60, **SETTINGS)
@given(name=st.sampled_from(LAYOUTS), n=odd_n, k=block_k, t=tokens, nt=st.integers(1, 3),
       vw=st.sampled_from([None, 8, 4]), scales=st.sampled_from(["normal", "extreme"]),
       seed=st.integers(0, 2**31))
def test_qmatmul(name, n, k, t, nt, vw, scales, seed):
    rng = np.random.default_rng(seed)
    w = gguf_weight(rng, name, n, k, scales)
    x = activations(rng, t, k)
    got, want = run_qmatmul(x, w, nt, vw)
    check_dot(got, want, x, w)


@pytest.mark.parametrize("vw", [None, 8, 4])
@pytest.mark.parametrize("t", [None, 7])
@pytest.mark.parametrize("name", LAYOUTS)
def test_qmatmul_every_layout_and_width(name, t, vw):
    """Each layout x decode/prefill x vector width, every thread count; K=96
    ends in a tail shorter than the main-loop step, K=512 has none."""
    rng = np.random.default_rng(5)
    for n, k in ((7, 96), (5, 512)):
        w = gguf_weight(rng, name, n, k, "extreme")
        x = activations(rng, t, k)
        for nt in (1, 2, 3):
            got, want = run_qmatmul(x, w, nt, vw)
            check_dot(got, want, x, w)


@pytest.mark.parametrize("name", LAYOUTS)
def test_qmatmul_long_rows_and_k_chunks(name):
    check_long_rows_and_k_chunks(lambda rng, n, k: gguf_weight(rng, name, n, k))


@settings(max_examples=12, **SETTINGS)
@given(name=st.sampled_from(LAYOUTS), n=odd_n, k=block_k, t=st.integers(1, 9), nt=st.integers(1, 3),
       chunk=st.sampled_from([32, 64]), seed=st.integers(0, 2**31))
def test_qmatmul_small_k_chunks(name, n, k, t, nt, chunk, seed):
    rng = np.random.default_rng(seed)
    w = gguf_weight(rng, name, n, k)
    x = activations(rng, t, k)
    saved, float_tiles.K_CHUNK = float_tiles.K_CHUNK, chunk
    try:
        got, want = run_qmatmul(x, w, nt)
    finally:
        float_tiles.K_CHUNK = saved
    check_dot(got, want, x, w)


@pytest.mark.parametrize("k", [1, 7, 33, 100])
def test_qmatmul_bf16_any_row_length(k):
    """BF16 is a block of one value: any K, with vector tails."""
    rng = np.random.default_rng(k)
    for t in (None, 4):
        w = gguf_weight(rng, "BF16", 9, k, "extreme")
        x = activations(rng, t, k)
        for vw in (None, 4):
            got, want = run_qmatmul(x, w, 2, vw)
            check_dot(got, want, x, w)


# --- native embedding ------------------------------------------------------------------------------
@settings(max_examples=40, **SETTINGS)
@given(name=st.sampled_from(LAYOUTS), v=odd_n, d=block_k, t=tokens, nt=st.integers(1, 3),
       vw=st.sampled_from([None, 8, 4]), scales=st.sampled_from(["normal", "extreme", "special", "bytes"]),
       seed=st.integers(0, 2**31))
def test_embedding(name, v, d, t, nt, vw, scales, seed):
    """Rows are decoded with the reference's own float32 operations: bit-exact,
    nan and inf included."""
    rng = np.random.default_rng(seed)
    w = gguf_weight(rng, name, v, d, scales)
    ids = rng.integers(0, v, size=() if t is None else (t,)).astype(np.int32)
    got = run_embedding(w, ids, nt, vw)
    with np.errstate(all="ignore"):
        want = embedding_ref(w, ids)
    np.testing.assert_array_equal(got, want)


# --- code quality ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["Q4_0", "Q5_1"])
def test_avx512_nibbles_use_permutes(name):
    """On AVX-512 the 4/5-bit types pick weights from a per-block table with
    vpermps / vpermi2ps instead of converting each nibble."""
    target = host_target()
    if not (target.has("avx512f") and target.vector_width == 16):
        pytest.skip(f"host {target.cpu} has no AVX-512")
    k = 4096
    sig = sig_for("qmatmul", [TensorType((k,)), TensorType((64, k), "f32", name)], layout=name)
    asm = emit_assembly(compiled(sig).module)
    assert len(re.findall(r"\bvperm[it]?2?\w*\s[^\n]*%zmm", asm)) >= 8, asm[:3000]
    assert not re.findall(r"\bvcvtdq2ps\s[^\n]*%zmm", asm)
