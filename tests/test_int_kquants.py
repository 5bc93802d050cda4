"""The K-quants' integer path of qmatmul (``act="q8k"``): activations
quantized to Q8_K blocks of 256 with per-16 sums, integer sub-block dot
products (``ir/int_dot.py``, ``compiler/codegen/matmul/int_kquants.py``).

The numpy reference is checked against a slow formula written with Python
ints straight from the block bytes; the native kernel against the
reference (VNNI and the portable path, widths 4/8/16, odd shapes, 1-3
threads, decode rows bit for bit); the ``int_dot`` pass; and a synthetic
K-quant GGUF model through the interpreter and through native code."""
from __future__ import annotations

import gguf
import gguf.quants
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import passes.int_dot  # noqa: F401  (registers the pass)
from compiler.codegen import matmul
from compiler.codegen.harness import CompiledKernel, run_kernel_like_reference, sig_for
from ir.int_dot import ACT_LAYOUTS, kquant_ints, quantize_q8k_rows
from ir.int_dot import int_act
from ir.ops import ShapeError, WeightData, get_op, qmatmul_ref
from ir.quant import quant_type
from ir.types import TensorType
from kernel_checks import call_with_guard, check_within, portable_target, same_tokens_interp_and_native
from test_kquants import random_blocks


#: the K-quants (the ternary types take act="q8k" too: tests/test_ternary.py)
KQ = [n for n in ACT_LAYOUTS["q8k"] if quant_type(n).family == "kquant"]
BLOCK_BYTES = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
#: what the kernel adds to the signed quants to make them unsigned bytes
OFFSET = {"Q3_K": 4, "Q6_K": 32}
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def kq_weight(rng: np.random.Generator, name: str, n: int, k: int, scales: str = "normal") -> WeightData:
    raw = random_blocks(rng, name, n * k // 256, scales).reshape(-1)
    return WeightData(raw, TensorType((n, k), "f32", name))


# --- an independent slow formula ---------------------------------------------------------------
def _f16(lo: int, hi: int) -> float:
    return float(np.frombuffer(bytes([lo, hi]), "<f2")[0])


def slow_q3k_scales(p: bytes) -> list[int]:
    """The sixteen signed scales of Q3_K as llama.cpp unpacks them: three
    little-endian words, rearranged with kmask1 = 0x03030303 and kmask2 =
    0x0f0f0f0f, read back as 16 bytes, minus 32."""
    a = [int.from_bytes(p[4 * i:4 * i + 4], "little") for i in range(3)] + [0]
    k1, k2 = 0x03030303, 0x0F0F0F0F
    tmp = a[2]
    a[2] = ((a[0] >> 4) & k2) | (((tmp >> 4) & k1) << 4)
    a[3] = ((a[1] >> 4) & k2) | (((tmp >> 6) & k1) << 4)
    a[0] = (a[0] & k2) | (((tmp >> 0) & k1) << 4)
    a[1] = (a[1] & k2) | (((tmp >> 2) & k1) << 4)
    return [((a[j // 4] >> (8 * (j % 4))) & 0xFF) - 32 for j in range(16)]


def slow_low_bit_block(name: str, b: bytes) -> tuple[float, float, list[int], list[int], list[int]]:
    """Q2_K and Q3_K as llama.cpp's dequantize_row_q2_K / _q3_K walk them:
    two halves of 128 values, four shifts of each qs byte, 16 values per scale."""
    q, sc, mn = [0] * 256, [0] * 256, [0] * 256
    s3 = slow_q3k_scales(b[96:108]) if name == "Q3_K" else None
    for v in range(256):
        h, r = divmod(v, 128)
        j, l = divmod(r, 32)
        if name == "Q2_K":
            q[v] = (b[16 + 32 * h + l] >> (2 * j)) & 3
            sc[v], mn[v] = b[v // 16] & 15, b[v // 16] >> 4
        else:
            hm = b[l] & (1 << (4 * h + j))
            q[v] = ((b[32 + 32 * h + l] >> (2 * j)) & 3) - (0 if hm else 4)
            sc[v] = s3[v // 16]
    if name == "Q2_K":
        return _f16(b[80], b[81]), _f16(b[82], b[83]), sc, mn, q
    return _f16(b[108], b[109]), 0.0, sc, mn, q


def slow_block(name: str, b: bytes) -> tuple[float, float, list[int], list[int], list[int]]:
    """(d, dmin, per-value scale, per-value min) x 256 and the quants of one
    super-block, byte by byte: value v = d * scale[v] * q[v] - dmin * mins[v]."""
    if name in ("Q2_K", "Q3_K"):
        return slow_low_bit_block(name, b)
    if name == "Q6_K":
        q, sc = [0] * 256, []
        for v in range(256):
            h, r = divmod(v, 128)
            i, l = divmod(r, 32)
            lo = b[64 * h + 32 * (i % 2) + l]
            lo = lo >> 4 if i >= 2 else lo & 15
            hi = (b[128 + 32 * h + l] >> (2 * i)) & 3
            q[v] = (lo | hi << 4) - 32
            s = b[192 + v // 16]
            sc.append(s - 256 if s >= 128 else s)
        return _f16(b[208], b[209]), 0.0, sc, [0] * 256, q
    p = b[4:16]

    def scale_min(s: int) -> tuple[int, int]:
        if s < 4:
            return p[s] & 63, p[s + 4] & 63
        return (p[s + 4] & 15) | (p[s - 4] >> 6) << 4, (p[s + 4] >> 4) | (p[s] >> 6) << 4

    q, sc, mn = [], [], []
    qs_at = 16 if name == "Q4_K" else 48
    for v in range(256):
        j, r = divmod(v, 64)
        h, l = divmod(r, 32)
        byte = b[qs_at + 32 * j + l]
        val = byte >> 4 if h else byte & 15
        if name == "Q5_K":
            val |= ((b[16 + l] >> (v // 32)) & 1) << 4
        q.append(val)
        s, m = scale_min(v // 32)
        sc.append(s)
        mn.append(m)
    return _f16(b[0], b[1]), _f16(b[2], b[3]), sc, mn, q


def slow_quantize(xs: np.ndarray) -> tuple[float, list[int]]:
    """quantize_row_q8_K for one block of 256, a value at a time (float32
    arithmetic, Python's round half to even)."""
    amax = np.float32(0)
    for v in xs:
        amax = max(amax, abs(np.float32(v)))
    if amax == 0:
        return 0.0, [0] * 256
    iscale = np.float32(127) / amax
    return float(np.float32(1) / iscale), [int(round(float(np.float32(v) * iscale))) for v in xs]


def slow_matvec(x: np.ndarray, w: WeightData) -> tuple[np.ndarray, np.ndarray]:
    """The integer-path result in float64 from Python ints, and the size of
    its terms (sum of |d_w d_x sc q_w q_x| and |dmin_w d_x m q_x| per value)."""
    name = w.type.layout
    n, k = (int(s) for s in w.type.shape)
    nb, bb = k // 256, BLOCK_BYTES[name]
    raw = bytes(np.asarray(w.raw, np.uint8))
    xq = [slow_quantize(x[i * 256:(i + 1) * 256]) for i in range(nb)]
    out, size = [], []
    for r in range(n):
        total = mag = 0.0
        for i in range(nb):
            o = (r * nb + i) * bb
            d, dmin, sc, mn, q = slow_block(name, raw[o:o + bb])
            dx, qx = xq[i]
            s1 = sum(sc[v] * q[v] * qx[v] for v in range(256))
            s2 = sum(mn[v] * qx[v] for v in range(256))
            total += d * dx * s1 - dmin * dx * s2
            # the kernel's terms: Q3_K / Q6_K add sc * (u q_x) and -bias sc q_x with u = q + bias
            bias = OFFSET.get(name, 0)
            mag += abs(d * dx) * sum(abs(sc[v]) * (abs(q[v] + bias) + bias) * abs(qx[v]) for v in range(256))
            mag += abs(dmin * dx) * sum(mn[v] * abs(qx[v]) for v in range(256))
        out.append(total)
        size.append(mag)
    return np.array(out), np.array(size)


# --- the reference ------------------------------------------------------------------------------
def _x(rng: np.random.Generator, k: int) -> np.ndarray:
    x = rng.standard_normal(k).astype(np.float32) * np.float32(3.0)
    x[256:512] = 0.0                                                   # a zero block: d = 0, q = 0
    x[512:768] = np.linspace(-1.0, 1.0, 256, dtype=np.float32) * np.float32(127 / 2)   # ties
    return x


@pytest.mark.parametrize("scales", ["normal", "extreme"])
@pytest.mark.parametrize("name", KQ)
def test_reference_matches_slow_formula(name, scales):
    rng = np.random.default_rng(3)
    w = kq_weight(rng, name, 4, 1024, scales)
    x = _x(rng, 1024)
    with np.errstate(all="ignore"):
        got = qmatmul_ref(x, w, layout=name, act="q8k")
        want, size = slow_matvec(x, w)
    assert got.dtype == np.float32 and got.shape == (4,)
    fin = np.isfinite(want)
    assert np.array_equal(np.isfinite(got), fin)
    # the float32 rounding of the result, and float64 rounding of the sum
    assert np.all(np.abs(got[fin] - want[fin]) <= 6e-8 * np.abs(want[fin]) + 1e-13 * size[fin] + 1e-38)


@pytest.mark.parametrize("name", KQ)
def test_integers_give_the_dequantized_values(name):
    """d * sc * q - dmin * m, rounded as llama.cpp's dequantizer rounds, is
    its dequantization: ours and the ``gguf`` package's."""
    w = kq_weight(np.random.default_rng(5), name, 3, 512, "extreme")
    wi = kquant_ints(w)
    sub = 256 // wi.sc.shape[2]
    f = (wi.d[:, :, None] * np.repeat(wi.sc, sub, axis=2).astype(np.float32))
    v = f * wi.q.astype(np.float32)
    if wi.m is not None:
        v = v - wi.dmin[:, :, None] * np.repeat(wi.m, sub, axis=2).astype(np.float32)
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(v.reshape(3, 512), w.to_f32())
        want = gguf.quants.dequantize(np.asarray(w.raw), gguf.GGMLQuantizationType[name]).reshape(3, 512)
        np.testing.assert_array_equal(v.reshape(3, 512), want)


@pytest.mark.parametrize("name", KQ)
def test_reference_is_the_float_product_of_rounded_x(name):
    """Odd shapes against the ``gguf`` package's dequantization in float64:
    the integer path differs from x @ W.T only by rounding x to its Q8_K
    quants, at most d_x / 2 per value, so by sum_v |w_v| d_x(v) / 2, plus
    the float32 rounding of the result."""
    rng = np.random.default_rng(6)
    for n, k, t in ((7, 256, 1), (13, 1280, 3), (3, 2304, 2)):
        w = kq_weight(rng, name, n, k)
        wf = gguf.quants.dequantize(np.asarray(w.raw), gguf.GGMLQuantizationType[name]).reshape(n, k)
        x = rng.standard_normal((t, k)).astype(np.float32) * np.float32(4.0)
        if k > 256:
            x[0, :256] = 0.0                                               # a zero block
        got = qmatmul_ref(x, w, layout=name, act="q8k")
        exact = x.astype(np.float64) @ wf.astype(np.float64).T
        dx, _, _ = quantize_q8k_rows(x)
        half_step = np.repeat(dx.astype(np.float64), 256, axis=1) / 2    # [t, k]
        # (1 + 1e-4): d_x and x * 127 / amax are float32 roundings themselves
        bound = half_step @ np.abs(wf.astype(np.float64)).T * (1 + 1e-4) + 1e-7 * np.abs(exact) + 1e-30
        assert np.all(np.abs(got - exact) <= bound), (name, n, k)
        assert np.abs(got - exact).max() > 0            # x really was rounded


def test_quantizer_scales_sums_and_rounding():
    x = np.zeros((1, 512), np.float32)
    x[0, 0], x[0, 1], x[0, 2], x[0, 3], x[0, 17] = -127.0, 0.5, 1.5, -2.5, 3.0
    d, q, bs = quantize_q8k_rows(x)
    assert d[0, 0] == np.float32(1.0) and d[0, 1] == 0.0
    assert list(q[0, 0, :4]) == [-127, 0, 2, -2]
    assert list(bs[0, 0, :2]) == [-127, 3] and not bs[0, 1].any()
    np.testing.assert_array_equal(bs, q.reshape(1, 2, 16, 16).sum(axis=3))


def test_reference_rows_and_closeness_to_float():
    rng = np.random.default_rng(4)
    w = kq_weight(rng, "Q4_K", 7, 512)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    rows = qmatmul_ref(x, w, layout="Q4_K", act="q8k")
    for t in range(3):
        np.testing.assert_array_equal(rows[t], qmatmul_ref(x[t], w, layout="Q4_K", act="q8k"))
    flt = qmatmul_ref(x, w, layout="Q4_K")
    assert np.abs(rows - flt).max() <= 0.02 * np.abs(flt).max()


def test_shape_rule():
    q = get_op("qmatmul")
    for name in KQ:
        wt = TensorType((8, 512), "f32", name)
        assert q.infer([TensorType((512,)), wt], {"layout": name, "act": "q8k"}).shape == (8,)
        assert int_act(name) == "q8k"
        with pytest.raises(ShapeError):
            q.infer([TensorType((512,)), wt], {"layout": name, "act": "q8"})
    with pytest.raises(ShapeError):
        q.infer([TensorType((64,)), TensorType((8, 64), "f32", "Q8_0")], {"layout": "Q8_0", "act": "q8k"})
    with pytest.raises(ShapeError):
        q.infer([TensorType((256,)), TensorType((8, 256), "f32", "BF16")], {"layout": "BF16", "act": "q8k"})


# --- the native kernel ----------------------------------------------------------------------------
_KERNELS: dict = {}


def compiled(sig, vector_width=None, portable=False) -> CompiledKernel:
    """One kernel per signature, width and path (``portable``: compiled for
    the host without x86 multiply-add instructions)."""
    key = (sig, vector_width, portable)
    if key not in _KERNELS:
        _KERNELS[key] = CompiledKernel(sig, vector_width=vector_width,
                                       target=portable_target(vector_width) if portable else None)
    return _KERNELS[key]


def ref_size(x: np.ndarray, w: WeightData) -> np.ndarray:
    """The size of the terms the kernel adds in float32, per output:
    sum over super-blocks of |d_w d_x| sum |sc| (u |q_x|) (+ b |sc q_x| for
    Q3_K, Q6_K: u = q + b, b = 4, 32) and |dmin_w d_x| sum m |q_x|."""
    k = int(w.type.shape[1])
    dx, qx, _ = quantize_q8k_rows(np.asarray(x, np.float32).reshape(-1, k))
    wi = kquant_ints(w)
    sub = 256 // wi.sc.shape[2]
    asc = np.abs(np.repeat(wi.sc, sub, axis=2)).astype(np.float64)
    off = OFFSET.get(w.type.layout, 0)
    u = np.abs(wi.q.astype(np.float64) + off) + off
    ax = np.abs(qx.astype(np.float64))
    s = np.einsum("nbv,mbv->mnb", asc * u, ax)
    s = np.einsum("mnb,nb,mb->mn", s, np.abs(wi.d.astype(np.float64)), np.abs(dx.astype(np.float64)))
    if wi.m is not None:
        sm = np.einsum("nbv,mbv->mnb", np.repeat(wi.m, sub, axis=2).astype(np.float64), ax)
        s += np.einsum("mnb,nb,mb->mn", sm, np.abs(wi.dmin.astype(np.float64)), np.abs(dx.astype(np.float64)))
    return s.reshape(np.shape(x)[:-1] + (int(w.type.shape[0]),))


def check_close(got, want, x, w, rel=1e-5):
    check_within(got, want, ref_size(x, w), rel)


def run_kq(x, w, nt, vw=None, portable=False, decode_rows=None):
    k = int(w.type.shape[1])
    attrs = {"decode_rows": decode_rows} if decode_rows else {}
    sig = sig_for("qmatmul", [TensorType((k,) if x.ndim == 1 else ("T", k)), w.type],
                  layout=w.type.layout, act="q8k", **attrs)
    sym = {"T": x.shape[0]} if x.ndim == 2 else None
    got = run_kernel_like_reference(sig, [x, w], nthreads=nt, symbols=sym,
                                    kernel=compiled(sig, vw, portable), scratch_floats=1 << 16)
    assert matmul.scratch_floats(sig) <= 1 << 16
    return got, qmatmul_ref(x, w, layout=w.type.layout, act="q8k")


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("vw", [4, 8, 16])
@pytest.mark.parametrize("name", KQ)
def test_kernel_every_layout_width_and_path(name, vw, portable):
    """x86 multiply-adds and the portable path, widths 4/8/16; odd N; one
    and several super-blocks; 1..3 threads; a zero block and ties in x."""
    rng = np.random.default_rng(8)
    for n, k in ((7, 256), (33, 1024), (5, 2304)):
        w = kq_weight(rng, name, n, k, "normal")
        x = _x(rng, k) if k >= 1024 else rng.standard_normal(k).astype(np.float32)
        for nt in (1, 2, 3):
            got, want = run_kq(x, w, nt, vw, portable)
            check_close(got, want, x, w)


@settings(max_examples=40, **SETTINGS)
@given(name=st.sampled_from(KQ), n=st.sampled_from([1, 3, 13]), nb=st.sampled_from([1, 2, 3, 5]),
       nt=st.integers(1, 3), vw=st.sampled_from([None, 8]), scales=st.sampled_from(["normal", "extreme"]),
       seed=st.integers(0, 2**31))
def test_kernel_random(name, n, nb, nt, vw, scales, seed):
    rng = np.random.default_rng(seed)
    k = 256 * nb
    w = kq_weight(rng, name, n, k, scales)
    x = rng.standard_normal(k).astype(np.float32) * np.float32(10.0 ** rng.uniform(-3, 3))
    got, want = run_kq(x, w, nt, vw)
    check_close(got, want, x, w)


@pytest.mark.parametrize("name", KQ)
def test_kernel_long_rows(name):
    """K >= 8192: tiles of several weight rows."""
    rng = np.random.default_rng(12)
    w = kq_weight(rng, name, 9, 8192)
    x = rng.standard_normal(8192).astype(np.float32)
    got, want = run_kq(x, w, 2)
    check_close(got, want, x, w)


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("name", KQ)
def test_decode_rows_equal_one_row_calls_bit_for_bit(name, portable):
    """Prompt rows and batches of decode rows (``decode_rows``) give each row
    exactly the one-row kernel's result; T below, at and above decode_rows;
    the scratch holds decode_rows slots and no more."""
    rng = np.random.default_rng(21)
    for n, k in ((7, 256), (33, 896), (9, 8192)):
        if k % 256:
            k = 1024
        w = kq_weight(rng, name, n, k, "normal")
        one = compiled(sig_for("qmatmul", [TensorType((k,)), w.type], layout=name, act="q8k"), portable=portable)
        for slots in (1, 3, 8):
            sig = sig_for("qmatmul", [TensorType(("T", k)), w.type], layout=name, act="q8k", decode_rows=slots)
            assert matmul.scratch_floats(sig) * 4 >= slots * k
            rows = compiled(sig, portable=portable)
            for T in (1, 3, 9, 13):
                x = rng.standard_normal((T, k)).astype(np.float32)
                for nt in (1, 3):
                    got = call_with_guard(rows, x, w, T, nt)
                    want = np.stack([call_with_guard(one, x[t], w, 1, nt) for t in range(T)])
                    np.testing.assert_array_equal(got, want)
                check_close(got, qmatmul_ref(x, w, layout=name, act="q8k"), x, w)


@pytest.mark.parametrize("name", KQ)
def test_multiply_adds_in_assembly(name):
    """On AVX-512 BW hosts the chunk products are vpmaddubsw, and with VNNI
    the scale multiply-add is vpdpwssd."""
    import re

    from compiler.codegen.jit import emit_assembly
    from compiler.codegen.target import host_target

    t = host_target()
    if not (t.triple.startswith("x86_64") and t.has("avx512bw")):
        pytest.skip(f"host {t.cpu} has no AVX-512 BW")
    k = 2048
    sig = sig_for("qmatmul", [TensorType((k,)), TensorType((64, k), "f32", name)], layout=name, act="q8k")
    asm = emit_assembly(compiled(sig, 16).module)
    assert re.findall(r"\bvpmaddubsw\s[^\n]*%zmm", asm), asm[:2000]
    if t.has("avx512vnni"):
        assert re.findall(r"\bvpdpwssd\s", asm)


# --- the pass and a whole model ------------------------------------------------------------------
@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q4_K"])
def test_k_quant_model_interpreter_and_native_agree(tmp_path, qtype):
    """A synthetic GGUF of each K-quant we can write, with the pass in the
    pipeline: every matmul on its weights takes the q8k path (prompt chunks
    the GEMM), the prompt's logits through the interpreter (the numpy
    reference) and through native code agree to float rounding (the tiny
    model's greedy tokens repeat the last one, so they alone say little),
    and greedy decoding, the prompt through prefill, gives the same tokens."""
    import compiler.driver
    import runtime
    from test_gguf_frontend import tiny

    passes_ = ("fuse_dequant", "int_dot")
    p, _ = tiny(tmp_path, qtype)
    model = compiler.driver.load_model(p)
    assert model.weights["blk.0.ffn_down"].type.layout == qtype
    for mode in ("decode", "prefill"):
        g = compiler.driver.model_graph(model, mode, compiler.driver.CompileOptions(passes=passes_))
        mms = [n for n in g.nodes if n.op == "qmatmul" and n.attrs["layout"] == qtype]
        assert mms and all(n.attrs.get("act") == "q8k" for n in mms), mode
        assert all(("gemm" in n.kernel) == (mode == "prefill") for n in mms), mode
    ids = [1, 200, 3, 77, 260, 9, 42, 5] * 3
    # f32 caches: the kernels' float rounding, not f16's steps on the last bits of K and V
    ref = runtime.load(p, backend="interp", passes=passes_, kv_type="f32").logits(ids)
    nat = runtime.load(p, backend="llvm", threads=2, use_cache=False, passes=passes_, kv_type="f32").logits(ids)
    assert np.shape(nat) == (len(ids), 300)
    assert np.abs(np.asarray(nat) - ref).max() <= 1e-5 * np.abs(ref).max()
    same_tokens_interp_and_native(p, passes_)


@pytest.mark.parametrize("name", ["Q2_K", "Q3_K", "Q4_K", "Q6_K"])
def test_row_block_of_a_split_weight(name):
    """``qmatmul_rows`` (a row block of a weight split for streaming, the
    attributes of the split qmatmul kept): the kernel writes the block's
    rows from the pointer it is given, at the full result's row stride, on
    the integer path too (the lowering points it at row0; its signature
    leaves row0 out, so the blocks of a weight share one kernel)."""
    from ir.ops import qmatmul_rows_ref

    rng = np.random.default_rng(31)
    n, k, row0, total = 5, 512, 3, 11
    w = kq_weight(rng, name, n, k)
    for x in (rng.standard_normal(k).astype(np.float32), rng.standard_normal((4, k)).astype(np.float32)):
        xt = TensorType((k,) if x.ndim == 1 else ("T", k))
        sig = sig_for("qmatmul_rows", [xt, w.type], layout=name, act="q8k", row0=row0, n_total=total,
                      **({"decode_rows": 8} if x.ndim == 2 else {}))
        assert "row0" not in sig.attr and matmul.scratch_floats(sig) > 0
        got = run_kernel_like_reference(sig, [x, w], nthreads=2, symbols={"T": x.shape[0]} if x.ndim == 2 else None,
                                        kernel=compiled(sig), scratch_floats=1 << 16)
        want = qmatmul_rows_ref(x, w, layout=name, row0=row0, n_total=total, act="q8k")
        lead = (slice(None),) * (x.ndim - 1)
        check_close(got[lead + (slice(0, n),)], want[lead + (slice(row0, row0 + n),)], x, w)
