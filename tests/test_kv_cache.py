"""The KV cache's storage types (``--kv-type f32|f16|q8``): the references'
rounding, the native kv_write / attention kernels on f16 and q8 caches
against them, state sizes, the plumbing from the CLI to the manifest, and
end-to-end runs (native against the interpreter, and against run.c).

q8 rows are GGUF Q8_0 blocks (float16 scale, 32 int8), so a q8 cache needs
head_dim a multiple of 32: stories260K (head_dim 8) must refuse it, and the
q8 end-to-end runs use synthetic GGUFs with head_dim 64.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import runtime
from compiler.codegen.harness import sig_for
from compiler.codegen.lower import state_layout
from compiler.driver import CompileOptions, build_graphs, load_model
from frontends.arch import ModelError
from ir import kv_codec, ops
from ir.interp import new_state, state_array
from ir.ops import ShapeError
from ir.types import TensorType, f32, i32, kv_cache_type
from runtime.cli import DEFAULT_MODEL, DEFAULT_TOKENIZER
from runtime.errors import RunError
from shared_data import ROOT, reference_cases
from test_gguf_frontend import float_native, tiny
from test_kernels_attention import WIDTHS, act, act_type, close, run

RUNC = reference_cases("stories260K_runc.json")
GREEDY = [c for c in RUNC if c["temperature"] == 0.0]
rng = np.random.default_rng(7)
threads = st.integers(1, 3)
widths = st.sampled_from(WIDTHS)
rows_t = st.one_of(st.none(), st.integers(1, 5))  # None: a decode row without the T axis

#: values at the edges of float16: its largest finite, the last value that
#: still rounds down to it, the first that overflows, subnormals, a tie
#: between 0 and the smallest subnormal, signed zeros
F16_EDGES = np.array([65504.0, 65519.99, 65520.0, -65520.0, 1e6, -3e38, 1e-8, -3e-8, 5.96e-8, 2.0 ** -25,
                      6.1e-5, 0.0, -0.0, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11], np.float32)


def lmc(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runtime.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)


def lead(a: list[int], b: list[int]) -> int:
    """How many leading tokens two runs share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# --- references -------------------------------------------------------------------
def test_f16_reference_rounds_to_nearest_even():
    cache = state_array(kv_cache_type("f16", 4, F16_EDGES.size))
    assert cache.dtype == np.float16
    ops.kv_write_ref(cache, F16_EDGES, 1)
    got = cache[1].astype(np.float64)
    assert got[0] == got[1] == 65504.0 and got[2] == np.inf and got[3] == -np.inf and got[5] == -np.inf
    assert got[6] == 0.0 and got[9] == 0.0                   # below half the smallest subnormal; a tie to even 0
    assert got[8] == 2.0 ** -24 and got[7] == -(2.0 ** -24)  # rounded to the smallest subnormal
    assert got[13] == 1.0 and got[14] == 1.0 + 2.0 ** -9      # ties to even at 1 + half an ulp (2^-10)
    assert np.signbit(got[12]) and not cache[[0, 2, 3]].any()
    np.testing.assert_array_equal(kv_codec.kv_read(cache, 1, 2)[0], got.astype(np.float32))


def test_q8_reference_blocks():
    """d = f16(max|x| / 127) first, then the 32 int8 q = rint(x * 127 / max|x|)
    (ties to even); a zero block is all zeros; reads give d * q."""
    D = 64
    cache = state_array(kv_cache_type("q8", 3, D))
    assert cache.dtype == np.uint8 and cache.shape == (3, 2 * 34)
    x = np.zeros((1, D), np.float32)
    x[0, :6] = [127.0, 0.5, 1.5, 2.5, -2.5, -127.0]  # block 0: d = 1, ties go to even
    ops.kv_write_ref(cache, x, 2)
    blk = cache[2, :34]
    assert blk[:2].view("<f2")[0] == 1.0
    np.testing.assert_array_equal(blk[2:8].view(np.int8), [127, 0, 2, 2, -2, -127])
    assert not blk[8:].any() and not cache[2, 34:].any() and not cache[:2].any()  # zero block, other rows
    r = kv_codec.kv_read(cache, 2, 3)[0]
    np.testing.assert_array_equal(r[:6], [127, 0, 2, 2, -2, -127])
    # ordinary data: each value within half a step (d/2) of the original
    y = (rng.standard_normal((3, D)) * 5).astype(np.float32)
    ops.kv_write_ref(cache, y, 0)
    d = np.abs(y.reshape(3, 2, 32)).max(2) / 127
    err = np.abs(kv_codec.kv_read(cache, 0, 3) - y).reshape(3, 2, 32)
    assert (err <= d[..., None] * (0.5 + 127 * 2.0 ** -11)).all()  # plus the f16 rounding of d


def test_shape_rules_refuse_other_caches():
    x = f32(64)
    with pytest.raises(ShapeError, match="KV cache"):
        ops.get_op("kv_write").infer([TensorType((8, 64), "i32"), x, i32()], {})
    with pytest.raises(ShapeError, match="KV cache"):
        ops.get_op("kv_write").infer([TensorType((8, 64), "f32", "Q4_0"), x, i32()], {})
    q8 = kv_cache_type("q8", 8, 64)
    with pytest.raises(ShapeError, match="head_dim"):
        ops.get_op("attention").infer([f32(64), q8, q8, i32()], dict(n_heads=8, n_kv_heads=8, head_dim=8))
    with pytest.raises(ShapeError, match="caches"):
        ops.get_op("attention").infer([f32(64), q8, kv_cache_type("f16", 8, 64), i32()],
                                      dict(n_heads=2, n_kv_heads=2, head_dim=32))
    with pytest.raises(ValueError, match="unknown KV cache type"):
        kv_cache_type("q3", 8, 64)


# --- kv_write kernels ----------------------------------------------------------------
def with_edges(x: np.ndarray, edges: np.ndarray, k: int) -> np.ndarray:
    """x with k randomly placed extreme values."""
    flat = x.reshape(-1)
    idx = rng.choice(flat.size, size=min(k, flat.size), replace=False)
    flat[idx] = rng.choice(edges, size=idx.size)
    return x


@given(T=rows_t, D=st.integers(1, 40), extra=st.integers(0, 4), pos=st.integers(0, 30), edges=st.integers(0, 6),
       nt=threads, vw=widths)
@settings(deadline=None, max_examples=60)
def test_kv_write_f16(T, D, extra, pos, edges, nt, vw):
    rows = T or 1
    S = pos + rows + extra
    cache = rng.standard_normal((S, D)).astype(np.float16)  # rows not written must stay as they are
    x = with_edges(act(T, D, 100.0), F16_EDGES, edges)
    sig = sig_for("kv_write", [kv_cache_type("f16", S, D), act_type(T, D), i32()])
    want = ops.kv_write_ref(cache.copy(), x, pos)
    got = run(sig, [cache, x, pos], pos=pos, T=rows, nthreads=nt, vw=vw, out=cache)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))  # bit for bit (inf, -0, subnormals)


#: per-block kinds of q8 data: ordinary, zero, huge (the f16 scale near its
#: top), beyond (the scale overflows to inf), tiny (the scale flushes to 0),
#: ties (max 127: x.5 values must round to even), one spike among small values
def q8_block(kind: str) -> np.ndarray:
    b = rng.standard_normal(32).astype(np.float32)
    if kind == "zero":
        return np.zeros(32, np.float32)
    if kind == "huge":
        return b / np.abs(b).max() * np.float32(8e6)
    if kind == "beyond":
        return b * np.float32(1e9)
    if kind == "tiny":
        return b * np.float32(1e-7)
    if kind == "ties":
        v = (rng.integers(-120, 120, 32) + 0.5).astype(np.float32)
        v[rng.integers(32)] = rng.choice([127.0, -127.0])
        return v
    if kind == "spike":
        b *= np.float32(1e-3)
        b[rng.integers(32)] = np.float32(50.0)
        return b
    return b


Q8_KINDS = ["normal", "zero", "huge", "beyond", "tiny", "ties", "spike"]


@given(T=rows_t, nb=st.integers(1, 4), extra=st.integers(0, 4), pos=st.integers(0, 30),
       kinds=st.lists(st.sampled_from(Q8_KINDS), min_size=20, max_size=20), nt=threads, vw=widths)
@settings(deadline=None, max_examples=60)
def test_kv_write_q8(T, nb, extra, pos, kinds, nt, vw):
    rows = T or 1
    D = 32 * nb
    S = pos + rows + extra
    ct = kv_cache_type("q8", S, D)
    cache = rng.integers(0, 256, (S, nb * 34)).astype(np.uint8)  # rows not written must stay as they are
    blocks = [q8_block(kinds[i % len(kinds)]) for i in range(rows * nb)]
    x = np.concatenate(blocks).reshape((D,) if T is None else (T, D))
    sig = sig_for("kv_write", [ct, act_type(T, D), i32()])
    want = ops.kv_write_ref(cache.copy(), x, pos)
    got = run(sig, [cache, x, pos], pos=pos, T=rows, nthreads=nt, vw=vw, out=cache)
    np.testing.assert_array_equal(got, want)  # scales and quants bit for bit


# --- attention kernels ------------------------------------------------------------------
def filled_cache(kind: str, S: int, width: int, scale: float) -> np.ndarray:
    c = state_array(kv_cache_type(kind, S, width))
    ops.kv_write_ref(c, (rng.standard_normal((S, width)) * scale).astype(np.float32), 0)
    return c


def poison(cache: np.ndarray, rows: slice) -> None:
    """Rows nobody may read become NaN (for q8: every block's scale)."""
    n = cache[rows].shape[0]
    if n == 0:
        return
    if cache.dtype == np.uint8:
        blk = cache[rows].reshape(n, -1, 34)
        blk[:, :, :2] = np.array([np.nan], "<f2").view(np.uint8)
        cache[rows] = blk.reshape(n, -1)
    else:
        cache[rows] = np.nan


def attention_kv_case(kind, T, hd, kvh, group, past, window, nt, vw, extra=3, qscale=1.0, vscale=1.0):
    H = kvh * group
    rows = T or 1
    S = past + rows + extra
    q = act(T, H * hd, qscale)
    kc = filled_cache(kind, S, kvh * hd, 1.0)
    vc = filled_cache(kind, S, kvh * hd, vscale)
    for c in (kc, vc):
        poison(c, slice(past + rows, None))
        if window:
            poison(c, slice(0, max(0, past + 1 - window)))
    attrs = dict(n_heads=H, n_kv_heads=kvh, head_dim=hd, scale=1.0 / math.sqrt(hd), window=window)
    ct = kv_cache_type(kind, S, kvh * hd)
    sig = sig_for("attention", [act_type(T, H * hd), ct, ct, i32()], **attrs)
    got = run(sig, [q, kc, vc, past], pos=past, T=rows, nthreads=nt, vw=vw)
    want = ops.attention_ref(q, kc, vc, past, **attrs)
    assert np.isfinite(want).all()
    close(got, want, rtol=1e-4, atol=2e-5)


@given(T=rows_t, hd=st.sampled_from([2, 6, 8, 16, 24, 64]), kvh=st.integers(1, 3), group=st.integers(1, 4),
       past=st.integers(0, 40), window=st.one_of(st.just(0), st.integers(1, 9)), nt=threads, vw=widths,
       vscale=st.sampled_from([1.0, 1e4]))
@settings(deadline=None, max_examples=60)
def test_attention_f16_cache(T, hd, kvh, group, past, window, nt, vw, vscale):
    attention_kv_case("f16", T, hd, kvh, group, past, window, nt, vw, vscale=vscale)


@given(T=rows_t, hd=st.sampled_from([32, 64, 96, 128, 256]), kvh=st.integers(1, 3), group=st.integers(1, 4),
       past=st.integers(0, 40), window=st.one_of(st.just(0), st.integers(1, 9)), nt=threads, vw=widths,
       vscale=st.sampled_from([1.0, 1e6]))
@settings(deadline=None, max_examples=60)
def test_attention_q8_cache(T, hd, kvh, group, past, window, nt, vw, vscale):
    attention_kv_case("q8", T, hd, kvh, group, past, window, nt, vw, vscale=vscale)


@pytest.mark.parametrize("kind", ["f16", "q8"])
@pytest.mark.parametrize("hd,kvh,group,window", [(64, 2, 2, 0), (128, 1, 4, 0), (256, 1, 4, 512), (32, 4, 1, 1000)])
def test_attention_kv_long_context(kind, hd, kvh, group, window):
    attention_kv_case(kind, None, hd, kvh, group, 2900, window, 2, WIDTHS[-1], extra=100)
    attention_kv_case(kind, 3, hd, kvh, group, 1500, window, 3, WIDTHS[-1])


@pytest.mark.parametrize("kind", ["f16", "q8"])
def test_attention_kv_peaked_scores(kind):
    for vw in WIDTHS:
        attention_kv_case(kind, 2, 32, 2, 2, 37, 0, 2, vw, qscale=30.0)


# --- sizes ---------------------------------------------------------------------------------
def test_cache_type_sizes():
    assert kv_cache_type("f32", 4096, 256).nbytes() == 4096 * 256 * 4
    assert kv_cache_type("f16", 4096, 256).nbytes() == 4096 * 256 * 2
    assert kv_cache_type("q8", 4096, 256).nbytes() == 4096 * 8 * 34
    with pytest.raises(ValueError, match="multiple of the block size"):
        kv_cache_type("q8", 16, 48).nbytes()


def test_state_sizes(tmp_path):
    """q8 is 34/128 of f32, f16 half, in the types, the interpreter's arrays
    and the native state allocation."""
    p, cfg = tiny(tmp_path, "Q8_0")
    m = load_model(p)
    sizes = {}
    for kv in ("f32", "f16", "q8"):
        g = build_graphs(m, CompileOptions(ctx=48, kv_type=kv))["decode"]
        assert len(g.states) == 2 * cfg.n_layers and g.meta["kv_type"] == kv
        types = sum(v.type.nbytes() for v in g.states.values())
        assert types == sum(a.nbytes for a in new_state(g).values())
        assert state_layout(g)[1] == types  # rows of 64-byte multiples: no padding here
        sizes[kv] = types
    assert sizes["f32"] == 2 * cfg.n_layers * 48 * cfg.kv_dim * 4
    assert sizes["f16"] * 2 == sizes["f32"]
    assert sizes["q8"] * 128 == sizes["f32"] * 34


def test_q8_needs_head_dim_multiple_of_32():
    with pytest.raises(ModelError, match="head_dim 8.*use --kv-type f16"):
        runtime.load(DEFAULT_MODEL, DEFAULT_TOKENIZER, kv_type="q8")
    with pytest.raises(ModelError, match="head_dim 8"):
        runtime.load(DEFAULT_MODEL, DEFAULT_TOKENIZER, kv_type="q8", backend="interp")
    r = lmc("run", str(DEFAULT_MODEL), "-z", str(DEFAULT_TOKENIZER), "-n", "4", "--kv-type", "q8")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "head_dim 8" in r.stderr and "f16" in r.stderr
    for cmd in (["run", str(DEFAULT_MODEL)], ["compile", str(DEFAULT_MODEL), "-o", "x.lmc"],
                ["bench", str(DEFAULT_MODEL)]):
        r = lmc(*cmd, "--kv-type", "q3")
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert "invalid choice: 'q3'" in r.stderr


# --- plumbing ---------------------------------------------------------------------------------
def test_load_kv_type_and_manifest(tmp_path):
    f32m = runtime.load(DEFAULT_MODEL, DEFAULT_TOKENIZER, threads=1, kv_type="f32")
    f16m = runtime.load(DEFAULT_MODEL, DEFAULT_TOKENIZER, threads=1)      # the default
    assert (f32m.kv_type, f16m.kv_type) == ("f32", "f16")
    assert f16m.kv_bytes * 2 == f32m.kv_bytes
    assert f16m.executor.manifest["kv_type"] == "f16"
    assert f16m.executor.manifest["cache_key"] != f32m.executor.manifest["cache_key"]
    with pytest.raises(RunError, match="--kv-type"):
        runtime.load(DEFAULT_MODEL, DEFAULT_TOKENIZER, kv_type="bf16")
    # an artifact keeps its KV type; asking for another one is an error
    art = tmp_path / "m.lmc"
    r = lmc("compile", str(DEFAULT_MODEL), "-z", str(DEFAULT_TOKENIZER), "-o", str(art), "--kv-type", "f16")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["kv_type"] == "f16"
    m = runtime.load(art, threads=1)
    assert m.kv_type == "f16" and m.kv_bytes == f16m.kv_bytes
    assert runtime.load(art, threads=1, kv_type="f16").kv_type == "f16"
    with pytest.raises(RunError, match="compiled with --kv-type f16"):
        runtime.load(art, kv_type="f32")
    # and its context: -c another one is an error (it was ignored), -c the same one is fine
    ctx = m.ctx
    assert runtime.load(art, threads=1, ctx=ctx).ctx == ctx
    r = lmc("run", str(art), "-c", str(ctx // 2), "-p", "Once", "-n", "2")
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert r.stderr.strip() == (f"lmc: error: {art}: compiled for a context of {ctx}, not {ctx // 2} "
                                f"(recompile it with -c {ctx // 2}, or leave -c out)")


@pytest.mark.parametrize("backend", ["llvm", "interp"])
def test_cli_run_json_reports_kv(backend):
    got = {}
    for kv in ("f32", "f16"):
        r = lmc("run", str(DEFAULT_MODEL), "-z", str(DEFAULT_TOKENIZER), "-p", "Once upon a time", "-n", "8",
                "--temp", "0", "--json", "--kv-type", kv, "--backend", backend, "-c", "256")
        assert r.returncode == 0, r.stderr
        got[kv] = json.loads(r.stdout)["stats"]
        assert got[kv]["kv_type"] == kv
    cfg = load_model(DEFAULT_MODEL).config
    assert got["f32"]["kv_bytes"] == 2 * cfg.n_layers * 256 * cfg.kv_dim * 4
    assert got["f16"]["kv_bytes"] * 2 == got["f32"]["kv_bytes"]


def test_bench_reports_kv():
    from runtime.tools.bench import run_bench

    r = run_bench(DEFAULT_MODEL, DEFAULT_TOKENIZER, threads=1, prompt_tokens=8, gen_tokens=4, runs=1,
                  backend="interp", probe_bytes=16 << 20, probe_repeats=1, kv_type="f16")
    cfg = load_model(DEFAULT_MODEL).config
    assert r["kv_type"] == "f16" and r["kv_bytes"] == 2 * cfg.n_layers * cfg.seq_len * cfg.kv_dim * 2


# --- end to end ------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("kv", ["f16", "q8"])
def test_synthetic_gguf_native_matches_interpreter(tmp_path, arch, kv):
    """head_dim 64; gemma3 adds sliding-window layers (window 4 < the prompt)."""
    kw = dict(arch="gemma3", extra={"sliding_window": 4}) if arch == "gemma3" else {}
    p, cfg = tiny(tmp_path, "Q8_0", **kw)
    ref = runtime.load(p, backend="interp", kv_type=kv)
    nat = runtime.load(p, backend="llvm", threads=2, kv_type=kv)
    ids = [1, 5, 77, 260, 9, 42, 7, 8, 100, 3, 4, 5]
    a, b = ref.logits(ids), float_native(p, kv_type=kv).logits(ids)
    scale = max(1.0, float(np.abs(a).max()))
    assert np.abs(a - b).max() <= 1e-3 * scale
    # the cache type is really in effect: rounding moves the logits, a little
    full = runtime.load(p, backend="interp", kv_type="f32").logits(ids)
    assert 1e-6 * scale < np.abs(a - full).max() < 0.05 * scale
    assert list(ref.generate(ids, 24, temperature=0.0)) == list(nat.generate(ids, 24, temperature=0.0))
    assert nat.kv_bytes == ref.kv_bytes == 2 * cfg.n_layers * cfg.seq_len * cfg.kv_dim * {"f16": 2, "q8": 34 / 32}[kv]


def test_stories260K_f16_native_matches_interpreter_and_runc():
    """Greedy runs with an f16 cache: native and interpreter give the same
    tokens; how far they follow run.c's (f32) greedy output is printed, and
    must be a good way."""
    nat = runtime.load(DEFAULT_MODEL, DEFAULT_TOKENIZER, kv_type="f16", threads=2)
    ref = runtime.load(DEFAULT_MODEL, DEFAULT_TOKENIZER, kv_type="f16", backend="interp")
    cases = GREEDY or [{"prompt_ids": nat.encode("Once upon a time"), "steps": 256, "generated_ids": None}]
    for case in cases:
        n = case["steps"] - len(case["prompt_ids"]) + 1
        a = list(nat.generate(case["prompt_ids"], n, temperature=0.0))
        b = list(ref.generate(case["prompt_ids"], n, temperature=0.0))
        assert a == b
        if case["generated_ids"] is not None:
            agree = lead(a, case["generated_ids"])
            print(f"f16 KV, {case['prompt']!r}: {agree}/{len(case['generated_ids'])} greedy tokens as run.c")
            assert agree >= 64
