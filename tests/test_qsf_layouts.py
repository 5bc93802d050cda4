"""QSF's block quant types (QSF_Q8, QSF_Q4, QSF_Q2, QSF_Q2S, QSF_TERNARY).

The numpy dequantizers (``ir/quant/qsf.py``) are checked bit for bit
against a slow per-value formula written from the format table; the
quantizers for their error bounds and against the plain quantizers they
must beat; the native decoders (``compiler/codegen/matmul/decode_qsf.py``)
against the op references in qmatmul (decode and prefill) and embedding,
called once per thread id as the step function would."""
from __future__ import annotations

import json
import re
import struct

import numpy as np
import pytest

from compiler.codegen.harness import sig_for
from compiler.codegen.jit import emit_assembly
from compiler.codegen.target import host_target
from ir.quant import get_layout
from ir.ops import WeightData, embedding_ref
from ir.types import TensorType
from kernel_checks import activations, check_dot, check_long_rows_and_k_chunks, compiled, run_embedding, run_qmatmul

LAYOUTS = ["QSF_Q8", "QSF_Q4", "QSF_Q2", "QSF_Q2S", "QSF_TERNARY"]
BLOCK_BYTES = {"QSF_Q8": 66, "QSF_Q4": 36, "QSF_Q2": 20, "QSF_Q2S": 18, "QSF_TERNARY": 18}
#: byte offsets of each block's f16 fields (d; z or m)
F16_FIELDS = {"QSF_Q8": (0,), "QSF_Q4": (0, 2), "QSF_Q2": (0, 2), "QSF_Q2S": (0,), "QSF_TERNARY": (0,)}
QK = 64
EXTREME_F16 = np.array([65504.0, -65504.0, 2.0 ** -14, -(2.0 ** -14), 2.0 ** -24, -(2.0 ** -24),
                        1023 * 2.0 ** -24, 0.0, -0.0, 1.0, -3.5, 1000.0], dtype=np.float16)
HOST_VW = host_target().vector_width


# --- the format table, one value at a time ------------------------------------------------------------
def slow_value(name: str, blk: bytes, j: int) -> np.float32:
    """Value j of one block, straight from the table in ir/quant/qsf.py
    (numpy float32 scalars: float32 operations in the table's order)."""
    f32 = np.float32

    def f16(at: int) -> np.float32:
        return f32(struct.unpack_from("<e", blk, at)[0])

    if name == "QSF_Q8":
        return f32(struct.unpack_from("<b", blk, 2 + j)[0]) * f16(0)
    if name == "QSF_Q4":
        byte = blk[4 + j % 32]
        q = byte & 0x0F if j < 32 else byte >> 4
        return (f32(q) - f16(2)) * f16(0)
    if name in ("QSF_Q2", "QSF_Q2S"):
        at = 4 if name == "QSF_Q2" else 2
        q = (blk[at + j % 16] >> (2 * (j // 16))) & 3
        if name == "QSF_Q2":
            return f32(q) * f16(0) + f16(2)
        return (f32(q) - f32(1.5)) * f16(0)
    sign = int.from_bytes(blk[2:10], "little")
    zero = int.from_bytes(blk[10:18], "little")
    d = f16(0)
    if zero >> j & 1:
        return f32(0.0)
    return -d if sign >> j & 1 else d


def random_blocks(rng: np.random.Generator, name: str, nblocks: int, scales: str) -> np.ndarray:
    """uint8 [nblocks, block_bytes]: random quants and bits; f16 fields that
    are ``bytes`` (random, non-finite ones made finite), ``extreme`` (finite
    f16 extremes) or ``normal`` (|d| in 1e-3..0.1; z in 0..15, m near 0)."""
    raw = rng.integers(0, 256, size=(nblocks, BLOCK_BYTES[name]), dtype=np.uint8)
    for i, off in enumerate(F16_FIELDS[name]):
        if scales == "bytes":
            bits = raw[:, off:off + 2].copy().view("<u2")
            bits[(bits & 0x7C00) == 0x7C00] &= 0xBFFF   # inf/nan -> a finite exponent
            f = bits.view("<f2")
        elif scales == "extreme":
            f = rng.choice(EXTREME_F16, nblocks)
        elif i == 0:
            f = rng.uniform(1e-3, 0.1, nblocks) * rng.choice([-1.0, 1.0], nblocks)
        else:
            f = rng.uniform(0, 15, nblocks) if name == "QSF_Q4" else rng.uniform(-0.1, 0.1, nblocks)
        raw[:, off:off + 2] = np.asarray(f, "<f2").reshape(-1, 1).view(np.uint8)
    return raw


def random_weight(rng, name: str, n: int, k: int, scales: str = "normal") -> WeightData:
    raw = random_blocks(rng, name, n * k // QK, scales).reshape(-1)
    return WeightData(raw, TensorType((n, k), "f32", name))


def quantized_weight(rng, name: str, n: int, k: int) -> WeightData:
    data = rng.standard_normal((n, k)).astype(np.float32) * np.float32(0.05)
    return WeightData(get_layout(name).quantize(data), TensorType((n, k), "f32", name))


def bits(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


# --- the layouts and their dequantizers ------------------------------------------------------------------
@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_sizes(name):
    lay = get_layout(name)
    assert (lay.name, lay.block, lay.block_bytes) == (name, QK, BLOCK_BYTES[name])
    assert lay.nbytes((3, 128)) == 3 * 2 * BLOCK_BYTES[name]
    with pytest.raises(ValueError, match="96"):
        lay.nbytes((2, 96))


@pytest.mark.parametrize("scales", ["bytes", "extreme"])
@pytest.mark.parametrize("name", LAYOUTS)
def test_dequantize_matches_the_table(name, scales):
    """Bit for bit, whole tensors and picked rows, on random blocks."""
    rng = np.random.default_rng(sum(map(ord, name + scales)))
    n, k = 6, 512
    raw = random_blocks(rng, name, n * k // QK, scales)
    want = np.array([[slow_value(name, bytes(blk), j) for j in range(QK)] for blk in raw],
                    np.float32).reshape(n, k)
    lay = get_layout(name)
    got = lay.dequantize(raw.reshape(-1), (n, k))
    assert got.dtype == np.float32 and got.shape == (n, k)
    np.testing.assert_array_equal(bits(got), bits(want))
    rows = np.array([[5, 0], [2, 2]])
    np.testing.assert_array_equal(bits(lay.dequantize_rows(raw.reshape(-1), (n, k), rows)), bits(want[rows]))


# --- the quantizers ------------------------------------------------------------------------------------
def mixed_blocks(rng: np.random.Generator, nblocks: int = 600) -> np.ndarray:
    """Blocks of different kinds at scales from 1e-3 to 1e3: Gaussian,
    Gaussian with an offset, heavy-tailed (Student t, 3 dof), uniform."""
    kinds = [rng.standard_normal((nblocks, QK)),
             rng.standard_normal((nblocks, QK)) + rng.uniform(-10, 10, (nblocks, 1)),
             rng.standard_t(3, (nblocks, QK)),
             rng.uniform(-1, 1, (nblocks, QK))]
    x = np.concatenate(kinds) * 10.0 ** rng.uniform(-3, 3, (len(kinds) * nblocks, 1))
    return x.astype(np.float32)


def round_trip(name: str, x: np.ndarray) -> np.ndarray:
    lay = get_layout(name)
    raw = lay.quantize_blocks(x)
    assert raw.dtype == np.uint8 and raw.shape == (len(x), lay.block_bytes)
    return lay.dequant_blocks(raw)


def sse(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return ((a.astype(np.float64) - b) ** 2).sum(axis=-1)


def to_f16(x) -> np.ndarray:
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


#: per block, max |error| <= bound * (max - min) or * max|x|. Q8 (absmax
#: rounding) is half a step of the f16-rounded scale; Q2S and ternary never
#: move a value further than max|x|; Q4 and Q2 may clip a block's extremes
#: when that lowers the squared error (measured: 0.08 and 0.38 of the range)
MAX_ERR = {"QSF_Q8": ("amax", 0.5 / 127 * (1 + 2.0 ** -10)), "QSF_Q4": ("range", 0.1),
           "QSF_Q2": ("range", 0.45), "QSF_Q2S": ("amax", 1 + 2.0 ** -10), "QSF_TERNARY": ("amax", 1 + 2.0 ** -10)}
#: per block, RMS error <= bound * range (amax for Q2S): the candidates
#: include the plain grids, whose errors are at most half a step
RMS_ERR = {"QSF_Q4": 0.5 / 15, "QSF_Q2": 0.5 / 3, "QSF_Q2S": 0.5 / 1.5}


@pytest.mark.parametrize("name", LAYOUTS)
def test_quantize_error_bounds(name):
    rng = np.random.default_rng(3)
    x = mixed_blocks(rng)
    y = round_trip(name, x)
    err = np.abs(y.astype(np.float64) - x)
    rng_ = x.max(1).astype(np.float64) - x.min(1)
    amax = np.abs(x).max(1).astype(np.float64)
    what, bound = MAX_ERR[name]
    ref = rng_ if what == "range" else amax
    assert np.all(err.max(1) <= bound * ref), (err.max(1) / ref).max()
    if name in RMS_ERR:
        rms = np.sqrt(sse(y, x) / QK)
        ref = amax if name == "QSF_Q2S" else rng_
        assert np.all(rms <= RMS_ERR[name] * ref * 1.01), (rms / ref).max()


def plain_round_trip(name: str, x: np.ndarray) -> np.ndarray:
    """The obvious quantizers, with f16-rounded parameters: min/max grids
    (Q4, Q2), outer levels on max|x| (Q2S), threshold 0.5 max|x| (ternary)."""
    mn, mx = x.min(1, keepdims=True), x.max(1, keepdims=True)
    amax = np.abs(x).max(1, keepdims=True)
    if name == "QSF_Q4":
        d = to_f16((mx - mn) / 15)
        z = to_f16(-mn / d)
        return (np.clip(np.rint(x / d + z), 0, 15) - z) * d
    if name == "QSF_Q2":
        d, m = to_f16((mx - mn) / 3), to_f16(mn)
        return np.clip(np.rint((x - m) / d), 0, 3) * d + m
    if name == "QSF_Q2S":
        d = to_f16(amax / 1.5)
        return (np.clip(np.rint(x / d + 1.5), 0, 3) - 1.5) * d
    keep = np.abs(x) > 0.5 * amax
    d = to_f16((np.abs(x) * keep).sum(1, keepdims=True) / keep.sum(1, keepdims=True))
    return np.where(keep, np.sign(x) * d, 0)


@pytest.mark.parametrize("name", ["QSF_Q4", "QSF_Q2", "QSF_Q2S", "QSF_TERNARY"])
def test_quantize_beats_the_plain_quantizer(name):
    """On Gaussian blocks the searches give a lower total squared error
    than the obvious choice (the ratios printed are what they gain)."""
    x = np.random.default_rng(4).standard_normal((2000, QK)).astype(np.float32)
    ours, plain = sse(round_trip(name, x), x).sum(), sse(plain_round_trip(name, x), x).sum()
    print(name, "squared error vs plain:", ours / plain)
    assert ours < 0.95 * plain


@pytest.mark.parametrize("name", LAYOUTS)
def test_constant_and_zero_blocks(name):
    """Zero blocks are exact everywhere; constant blocks of f16 values are
    exact except in Q8, whose scale is fixed at max|x| / 127."""
    consts = to_f16([3.25, -0.7, 1000.0, -2e-3, 6e-5, 60000.0, 0.0])
    x = np.repeat(consts[:, None], QK, axis=1)
    y = round_trip(name, x)
    np.testing.assert_array_equal(y[-1], 0)
    if name == "QSF_Q8":
        assert np.all(np.abs(y - x) <= np.abs(x) * (0.5 / 127 * 1.001))
    else:
        np.testing.assert_array_equal(y, x)
    if name == "QSF_TERNARY":  # zeros and one magnitude of both signs: exact as well
        z = np.where(np.arange(QK) % 3 == 0, 0.0, np.where(np.arange(QK) % 3 == 1, 0.75, -0.75))[None]
        np.testing.assert_array_equal(round_trip(name, z.astype(np.float32)), z)


@pytest.mark.parametrize("name", LAYOUTS)
def test_quantize_whole_tensors_and_bad_input(name):
    lay = get_layout(name)
    rng = np.random.default_rng(5)
    m = rng.standard_normal((3, 192)).astype(np.float32)
    raw = lay.quantize(m)
    assert raw.dtype == np.uint8 and raw.shape == (3 * 3 * lay.block_bytes,)
    np.testing.assert_array_equal(raw.reshape(9, -1), lay.quantize_blocks(m.reshape(9, QK)))
    np.testing.assert_array_equal(lay.dequantize(raw, (3, 192)), lay.dequant_blocks(raw.reshape(9, -1)).reshape(3, 192))
    with pytest.raises(ValueError, match="100 columns"):
        lay.quantize(np.zeros((2, 100), np.float32))
    for bad in (np.nan, np.inf, -np.inf):
        m2 = m.copy()
        m2[1, 7] = bad
        with pytest.raises(ValueError, match="non-finite"):
            lay.quantize(m2)
    with pytest.raises(ValueError, match="too large"):
        lay.quantize(np.full((1, QK), 1e12, np.float32))


def test_quantize_in_chunks(monkeypatch):
    """Large tensors go through quantize_blocks a chunk at a time: same bytes."""
    from ir.quant.qsf import QSFLayout

    x = np.random.default_rng(6).standard_normal((5, 320)).astype(np.float32)
    whole = {n: get_layout(n).quantize(x) for n in LAYOUTS}
    monkeypatch.setattr(QSFLayout, "chunk", 3)
    for n in LAYOUTS:
        np.testing.assert_array_equal(get_layout(n).quantize(x), whole[n])


# --- native qmatmul and embedding ----------------------------------------------------------------------
#: (N, K) per vector width: two shapes at every width, all four at the host's
SHAPES = [(7, 192), (130, 640), (1, 64), (64, 640)]


@pytest.mark.parametrize("t", [None, 5], ids=["decode", "prefill"])
@pytest.mark.parametrize("vw", [4, 8, 16])
@pytest.mark.parametrize("name", LAYOUTS)
def test_qmatmul(name, vw, t):
    """Each layout x vector width x decode/prefill, on quantized weights and on
    random blocks with extreme f16 scales, 1-3 threads."""
    rng = np.random.default_rng(sum(map(ord, name)) + 10 * vw + (t or 0))
    shapes = SHAPES if vw == HOST_VW else SHAPES[:2]
    for i, (n, k) in enumerate(shapes):
        for j, w in enumerate((quantized_weight(rng, name, n, k), random_weight(rng, name, n, k, "extreme"))):
            x = activations(rng, t, k)
            got, want = run_qmatmul(x, w, 1 + (i + j) % 3, vw)
            check_dot(got, want, x, w)


@pytest.mark.parametrize("name", LAYOUTS)
def test_qmatmul_long_rows_and_k_chunks(name):
    check_long_rows_and_k_chunks(lambda rng, n, k: random_weight(rng, name, n, k))


@pytest.mark.parametrize("vw", [4, 8, 16])
@pytest.mark.parametrize("name", LAYOUTS)
def test_embedding(name, vw):
    """Rows are decoded with the reference's own float32 operations: the
    same bits, on random blocks with any finite f16 fields."""
    rng = np.random.default_rng(len(name) * vw)
    v, d = 130, 192
    w = random_weight(rng, name, v, d, "bytes")
    cases = [rng.integers(0, v, size=9), np.array([0, v - 1])]
    if vw == HOST_VW:
        cases.append(np.array(v // 2))  # a decode step: one id, shape ()
    for nt, ids in enumerate(cases, 1):
        got = run_embedding(w, ids, nt, vw)
        np.testing.assert_array_equal(bits(got), bits(embedding_ref(w, ids)))


@pytest.mark.parametrize("name", ["QSF_Q4", "QSF_Q2", "QSF_Q2S"])
def test_avx512_uses_permutes(name):
    """On AVX-512 the 4- and 2-bit types pick each weight from a per-block
    table with vpermps instead of converting and scaling every quant."""
    target = host_target()
    if not (target.has("avx512f") and target.vector_width == 16):
        pytest.skip(f"host {target.cpu} has no AVX-512")
    k = 4096
    sig = sig_for("qmatmul", [TensorType((k,)), TensorType((64, k), "f32", name)], layout=name)
    asm = emit_assembly(compiled(sig).module)
    assert len(re.findall(r"\bvperm\w*\s[^\n]*%zmm", asm)) >= 8, asm[:3000]
    assert not re.findall(r"\bvcvtdq2ps\s[^\n]*%zmm", asm)


# --- the compiler around them ------------------------------------------------------------------------------
def test_int_dot_marks_qsf_too():
    """The integer dot pass marks a decode qmatmul on Q8_0 and on every QSF
    type (``ir.int_dot``, ``matmul/int_qsf``) alike."""
    from compiler.pipeline import run_pipeline
    from ir.graph import Graph, WeightRef

    for layout, want in [("Q8_0", "q8"), *((n, "q8") for n in LAYOUTS)]:
        g = Graph("decode")
        g.meta["mode"] = "decode"
        x = g.add_input("x", TensorType((128,)))
        t = TensorType((8, 128), "f32", layout)
        w = g.add_weight("w", t, WeightRef("none", 0, get_layout(layout).nbytes(t.shape)))
        g.set_outputs(g.add_node("matmul", [x, g.add_node("dequant", [w])]))
        g = run_pipeline(g, ["fuse_dequant", "int_dot"])
        (node,) = [n for n in g.nodes if n.op == "qmatmul"]
        assert node.attrs["layout"] == layout and node.attrs.get("act") == want


@pytest.mark.parametrize("kind, extra", [("qmatvec", []), ("qmatmul", ["--batch", "5"])])
def test_lmc_kernel_accepts_qsf(capsys, kind, extra):
    """``lmc kernel qmatvec --qtype QSF_...``: the lab quantizes its random
    weight with the layout's own quantizer and checks the native kernel."""
    from runtime.tools import kernel_lab
    from runtime.cli import main

    assert set(LAYOUTS) <= set(kernel_lab.supported_layouts())
    for qtype in (["QSF_Q4", "QSF_TERNARY"] if kind == "qmatvec" else ["QSF_Q2"]):
        rc = main(["kernel", kind, "--qtype", qtype, "--rows", "64", "--cols", "256", *extra,
                   "-t", "1", "--repeats", "1", "--hot", "--json"])
        r = json.loads(capsys.readouterr().out)
        assert rc == 0 and r["correct"] is True and r["qtype"] == qtype, r
        # the integer path where the compiler takes it (VNNI), checked against its q8 reference
        want = "int" if kernel_lab.default_int_dot(kernel_lab.Problem(kind, 64, 256, qtype=qtype)) else "float"
        assert r["params"]["dot"] == want and r["max_abs_error"] < 1e-4
    assert main(["kernel", "qmatvec", "--qtype", "QSF_Q4", "--rows", "8", "--cols", "96"]) == 2
    assert "block of 64" in capsys.readouterr().err
