"""GGUF K-quants (Q2_K .. Q6_K): the numpy dequantizers against the
``gguf`` package, and the fused native decoders (qmatmul decode / prefill,
embedding) against the ``ir.ops`` references.

Kernels are specialised on their signature, so the shapes here come from a
small set (one odd N per K) and compiled kernels are cached per signature;
the token count T, the thread count and the data vary freely."""
from __future__ import annotations

import re

import gguf
import gguf.quants
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compiler.codegen.harness import sig_for
from compiler.codegen.jit import emit_assembly
from compiler.codegen.target import host_target
from ir.quant import get_layout
from ir.ops import WeightData, embedding_ref
from ir.types import TensorType
from kernel_checks import activations, check_dot, compiled, run_embedding, run_qmatmul

# get_layout only auto-loads the ir/layouts_*.py modules while no layout is
# registered; another module importing one of them by name (as the GGUF
# decoders do) would hide the rest. Load them all before any test runs.

KQUANTS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
#: byte offsets of the f16 super-block scales (d, then dmin where there is one)
SCALE_AT = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82), "Q3_K": (108,)}
#: one odd row count per K, so that kernels are shared between examples
N_FOR_K = {256: 9, 512: 7, 768: 5}
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])



# --- super-blocks -------------------------------------------------------------------
EXTREME_F16 = np.array([65504.0, -65504.0, 6e-8, -6e-8, 6.1e-5, 0.0, -0.0, 1.0, -3.5, 1e-3], np.float16)


def random_blocks(rng: np.random.Generator, layout: str, nblocks: int, scales: str) -> np.ndarray:
    """uint8 [nblocks, block_bytes]: random quants and packed sub-block scales;
    the f16 d / dmin from ``scales``: "bytes" (anything, inf and NaN
    included), "normal" (small, both signs) or "extreme" (huge, tiny,
    subnormal, zero, negative)."""
    lay = get_layout(layout)
    raw = rng.integers(0, 256, size=(nblocks, lay.block_bytes), dtype=np.uint8)
    if scales == "bytes":
        return raw
    for at in SCALE_AT[layout]:
        if scales == "normal":
            v = (rng.uniform(1e-4, 1e-2, nblocks) * rng.choice([-1.0, 1.0], nblocks)).astype(np.float16)
        elif scales == "extreme":
            v = rng.choice(EXTREME_F16, nblocks)
        else:
            raise ValueError(scales)
        raw[:, at:at + 2] = v.astype("<f2").view(np.uint8).reshape(nblocks, 2)
    return raw


def kquant_weight(rng, layout: str, n: int, k: int, scales: str = "normal") -> WeightData:
    raw = random_blocks(rng, layout, n * k // 256, scales).reshape(-1)
    t = TensorType((n, k), "f32", layout)
    assert get_layout(layout).nbytes(t.shape) == raw.size
    return WeightData(raw, t)


# --- numpy dequantizers ----------------------------------------------------------------
@pytest.mark.parametrize("layout", KQUANTS)
@pytest.mark.parametrize("scales", ["bytes", "extreme", "normal"])
def test_dequant_matches_gguf(layout, scales):
    rng = np.random.default_rng(len(layout) * 100 + len(scales))
    blocks = random_blocks(rng, layout, 257, scales)
    qtype = gguf.GGMLQuantizationType[layout]
    with np.errstate(invalid="ignore", over="ignore"):
        want = gguf.quants.dequantize(blocks.reshape(-1), qtype).reshape(-1, 256)
        got = get_layout(layout).dequant_blocks(blocks)
    assert got.dtype == np.float32 and got.shape == want.shape
    # the same float32 operations in the same order: bit for bit
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("layout", KQUANTS)
def test_dequant_rows_and_sizes(layout):
    rng = np.random.default_rng(5)
    lay = get_layout(layout)
    w = kquant_weight(rng, layout, 6, 768)
    full = w.to_f32()
    assert full.shape == (6, 768)
    ids = np.array([[5, 0], [3, 3]])
    np.testing.assert_array_equal(w.rows(ids), full[ids])
    assert lay.nbytes((6, 768)) == 6 * 3 * lay.block_bytes
    with pytest.raises(ValueError, match="multiple of the block size"):
        lay.nbytes((6, 640))


def test_roundtrip_gguf_quantizer():
    """gguf.quants has no quantizers for the K-quants (only dequantizers)."""
    x = np.zeros((1, 256), np.float32)
    for layout in KQUANTS:
        try:
            gguf.quants.quantize(x, gguf.GGMLQuantizationType[layout])
        except NotImplementedError:
            continue
        pytest.fail(f"gguf.quants can quantize {layout} now: add its round trip here")
    pytest.skip("gguf.quants cannot quantize Q2_K .. Q6_K (NotImplementedError); "
                "Q4_K's round trip uses frontends.quantize instead")


@settings(max_examples=15, **SETTINGS)
@given(seed=st.integers(0, 2**31), scale=st.floats(1e-3, 1e3), shift=st.floats(-5, 5))
def test_roundtrip_q4_k_quantizer(seed, scale, shift):
    """frontends.quantize's Q4_K writer, read back by our dequantizer: every
    value within about half a quantization step of its sub-block."""
    from frontends.quantize import quantize_q4_k

    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((4, 512)) * scale + shift * scale).astype(np.float32)
    raw = quantize_q4_k(x)
    y = get_layout("Q4_K").dequantize(raw.reshape(-1), x.shape)
    xs, ys = x.reshape(-1, 32).astype(np.float64), y.reshape(-1, 32)
    step = (xs.max(axis=1) - np.minimum(xs.min(axis=1), 0)) / 15
    err = np.abs(xs - ys).max(axis=1)
    assert np.all(err <= 0.6 * step + 1e-3 * np.abs(xs).max()), (err / step).max()


@settings(max_examples=15, **SETTINGS)
@given(seed=st.integers(0, 2**31), scale=st.floats(1e-3, 1e3), shift=st.floats(-5, 5))
def test_roundtrip_q2_k_q3_k_quantizers(seed, scale, shift):
    """frontends.quantize's Q2_K and Q3_K writers, read back by the gguf
    package's dequantizer: every value within what the codes allow. Q2_K:
    half a step of its 16 values, the min code's rounding (dmin / 2) and
    the scale code's (3 d / 2 at the top of the range); Q3_K: a step (the
    value opposite the largest in sign may need +4, clipped to 3) and the
    signed scale code's rounding or clipping (at most d per step of 4)."""
    from frontends.quantize import quantize_q2_k, quantize_q3_k

    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((3, 512)) * scale + shift * scale).astype(np.float32)
    tiny = 2e-3 * np.abs(x).max()                   # float16 d, dmin
    for name, quantize in (("Q2_K", quantize_q2_k), ("Q3_K", quantize_q3_k)):
        raw = quantize(x)
        assert raw.shape == (3, 2 * get_layout(name).block_bytes)
        y = gguf.quants.dequantize(raw.reshape(-1), gguf.GGMLQuantizationType[name]).reshape(x.shape)
        np.testing.assert_array_equal(y, get_layout(name).dequantize(raw.reshape(-1), x.shape))
        blk = raw.reshape(-1, get_layout(name).block_bytes)
        xs, ys = x.reshape(-1, 16, 16).astype(np.float64), y.reshape(-1, 16, 16)
        err = np.abs(xs - ys).max(axis=2)          # per 16 values
        if name == "Q2_K":
            d, dmin = (blk[:, at:at + 2].copy().view("<f2").astype(np.float64) for at in (80, 82))
            step = d * (blk[:, 0:16] & 15)
            bound = 0.5 * step + 0.5 * dmin + 1.5 * d
        else:
            from ir.quant.kquants import scales_q3k

            d = np.abs(blk[:, 108:110].copy().view("<f2").astype(np.float64))
            step = d * np.abs(scales_q3k(blk[:, 96:108]).astype(np.float64))
            bound = step + 4 * d
        assert np.all(err <= bound + tiny), (name, (err - bound).max())


# --- native kernels ------------------------------------------------------------------------


#: (K, vector width): every K at the host's width, the narrow (AVX2 / NEON) widths once
SHAPES = [(256, None), (512, None), (768, None), (512, 8), (768, 4)]


@settings(max_examples=40, **SETTINGS)
@given(layout=st.sampled_from(KQUANTS), shape=st.sampled_from(SHAPES),
       t=st.one_of(st.none(), st.integers(1, 9)), nt=st.integers(1, 3),
       scales=st.sampled_from(["normal", "extreme"]), seed=st.integers(0, 2**31))
def test_qmatmul_kquants(layout, shape, t, nt, scales, seed):
    k, vw = shape
    rng = np.random.default_rng(seed)
    w = kquant_weight(rng, layout, N_FOR_K[k], k, scales)
    x = activations(rng, t, k)
    got, want = run_qmatmul(x, w, nt, vw)
    check_dot(got, want, x, w, floor=1e-30)


@pytest.mark.parametrize("layout", KQUANTS)
@pytest.mark.parametrize("n,k,t", [
    (5, 8192, None),   # long rows: decode takes 4 rows at a time (plus one)
    (3, 2048, 7),      # prefill splits K into chunks (partial sums added in out)
    (1, 256, 9),
])
def test_qmatmul_kquants_paths(layout, n, k, t):
    rng = np.random.default_rng(n * k)
    w = kquant_weight(rng, layout, n, k, "extreme")
    x = activations(rng, t, k)
    for nt in (1, 3):
        got, want = run_qmatmul(x, w, nt)
        check_dot(got, want, x, w, floor=1e-30)


@settings(max_examples=15, **SETTINGS)
@given(layout=st.sampled_from(KQUANTS), t=st.one_of(st.none(), st.integers(1, 9)),
       nt=st.integers(1, 3), scales=st.sampled_from(["normal", "extreme"]), seed=st.integers(0, 2**31))
def test_embedding_kquants(layout, t, nt, scales, seed):
    rng = np.random.default_rng(seed)
    v, d = 7, 512
    w = kquant_weight(rng, layout, v, d, scales)
    ids = rng.integers(0, v, size=() if t is None else (t,)).astype(np.int32)
    got = run_embedding(w, ids, nt)
    want = embedding_ref(w, ids)
    if layout in ("Q3_K", "Q6_K"):   # q * (d*sc): the reference's own operations
        np.testing.assert_array_equal(got, want)
    else:                  # fma(q, d*sc, -dmin*m): one rounding instead of two
        f = w.to_f32()
        tol = 4 * np.spacing(np.abs(f).max(axis=1).astype(np.float32))[np.asarray(ids)]
        err = np.abs(got - want)
        assert np.all(err <= tol[..., None]), err.max()


def test_decode_uses_embedded_broadcasts():
    """On AVX-512 the sub-block factors reach the FMAs as {1to16} memory
    operands, not as a shuffle per factor (see matmul/decode_kquants)."""
    if not host_target().has("avx512f"):
        pytest.skip("no AVX-512 on this host")
    for layout in KQUANTS:
        sig = sig_for("qmatmul", [TensorType((2048,)), TensorType((64, 2048), "f32", layout)], layout=layout)
        asm = emit_assembly(compiled(sig).module)
        assert len(re.findall(r"\{1to16\}", asm)) >= 16, (layout, asm[:3000])
