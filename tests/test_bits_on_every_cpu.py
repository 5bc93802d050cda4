"""A token's numbers are the same bits however it runs (a decode step, a row
of a served batch or of a speculative check, a prompt chunk of repacked
weights; a norm fused into the matmul or not), whatever CPU the kernels are
compiled for.

Each pair of kernels that makes that promise is compiled here for several
LLVM CPUs and feature sets that this host can run (``Target.variant``: the
host's instructions less some, scheduled for another CPU) and run on the
same numbers. The promise holds by construction: the arithmetic is strict
(no fast-math flags, explicit fused multiply-adds), so LLVM cannot order or
fuse it one way in one kernel and another way in the other. Before that,
on an Emerald Rapids host, Q4_1 and Q5_1 decode rows differed from one-row
calls by an ulp: the sum of a dot product's accumulators carried
reassociation flags, and LLVM summed them in another order beside other
rows than alone.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from compiler.codegen.harness import CompiledKernel, scratch_floats_for, sig_for
from compiler.codegen.target import Target, amx_status, host_target, vnni_width, without_amx
from ir import kv_codec
from ir.interp import state_array
from ir.quant import quant_type
from ir.quant.repack import REPACKABLE
from ir.ops import WeightData
from ir.types import TensorType, f32, i32, kv_cache_type
from test_gguf_layouts import gguf_weight
from test_int_qsf import qsf_weight
from test_kquants import kquant_weight
from test_lut_types import LUT, lut_weight
from test_repacked_kernels import repacked
from test_ternary import tq_weight

X86 = host_target().triple.startswith(("x86_64", "i386", "i686"))
#: (label, LLVM CPU, feature prefixes dropped from the host's, features the host must have)
VARIANTS = [
    ("host", None, (), ()),
    ("sapphirerapids", "sapphirerapids", (), ("avx512f", "avx512bw", "avx512vl", "avx512vnni")),
    ("znver4", "znver4", ("amx", "avx512fp16", "avxvnni", "avxifma", "avxneconvert"),
     ("avx512f", "avx512bw", "avx512vl", "avx512vnni")),
    ("x86-64-v3, no AVX-512", "x86-64-v3", ("avx512", "amx"), ("avx2", "fma")),
    ("haswell, no AVX-512 or VNNI", "haswell", ("avx512", "amx", "avxvnni"), ("avx2", "fma")),
]


#: Not here: icelake-server (AVX-512 with VNNI, no AMX). The emitters branch on features, not on
#: CPU names, so its kernels are znver4's IR under a third scheduling model (the host's and
#: znver4's are two); it cost 113 s of a CI run's 68 worker-minutes.
#: LLVM CPU names of one processor model (the same scheduling and tuning): a variant that
#: keeps the host's features under another of its names compiles to the host's code (on an
#: Emerald Rapids host, sapphirerapids gave the same assembly for Q4_K, Q5_0, Q4_1 and Q6_K
#: matmuls and attention)
SAME_MODEL = ({"sapphirerapids", "emeraldrapids"},)


def variant(label: str) -> Target:
    """The target of ``label``, or a skip saying what the host lacks for it
    (or that it is the host's own code under another name)."""
    _, cpu, drop, needs = next(v for v in VARIANTS if v[0] == label)
    host = host_target()
    if cpu is None:
        return host
    if not drop and (cpu == host.cpu or any({cpu, host.cpu} <= names for names in SAME_MODEL)):
        pytest.skip(f"{label}: the host's LLVM processor model ({host.cpu}) and features, so the 'host' "
                    f"variant's code")
    if not X86:
        pytest.skip(f"{label}: an x86 CPU, and this host is {host.triple}")
    missing = [f for f in needs if not host.has(f)]
    if missing:
        pytest.skip(f"{label}: this host ({host.cpu}) lacks {', '.join(missing)}")
    return host.variant(cpu, drop)


LABELS = [v[0] for v in VARIANTS]
_KERNELS: dict[tuple, CompiledKernel] = {}


def kernel(sig, target: Target) -> CompiledKernel:
    key = (sig, target)
    if key not in _KERNELS:
        _KERNELS[key] = CompiledKernel(sig, target=target)
    return _KERNELS[key]


def call(k: CompiledKernel, args: list[Any], T: int = 1, nt: int = 1, pos: int = 0) -> np.ndarray:
    """Every thread id in turn, each with its own scratch (filled with garbage)."""
    shape = tuple(T if isinstance(d, str) else d for d in k.sig.out_type.shape)
    out = np.full(shape, np.nan, np.float32)
    need = scratch_floats_for(k.sig) + 64
    for tid in range(nt):
        scratch = np.full(need, 12345.0, np.float32)
        k(out, args, pos=pos, T=T, tid=tid, nthreads=nt, scratch=scratch)
    assert np.isfinite(out).all(), "an output element was not written"
    return out


def same_bits(got: np.ndarray, want: np.ndarray, what: str) -> None:
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=what)


def float_weight(rng, layout: str, n: int, k: int) -> WeightData:
    if layout in ("F32", "F16"):
        a = rng.standard_normal((n, k)).astype("<f4" if layout == "F32" else "<f2")
        return WeightData(a.view(np.uint8).reshape(-1), TensorType((n, k), "f32", layout))
    if layout.endswith("_K"):
        return kquant_weight(rng, layout, n, k)
    if layout.startswith("QSF"):
        return qsf_weight(rng, layout, n, k)
    if layout.startswith("TQ"):
        return tq_weight(rng, layout, n, k)
    if layout in LUT:
        return lut_weight(rng, layout, n, k)
    return gguf_weight(rng, layout, n, k)


def shapes(layout: str) -> tuple[tuple[int, int], ...]:
    """(rows, K): short rows (one at a time) with a tail after the unrolled
    steps, and long ones (4-row tiles), in whole blocks of the layout."""
    if layout.endswith("_K") or layout.startswith("TQ") or layout == "IQ4_XS":     # 256-value blocks
        return (33, 1280), (9, 8448)
    if layout.startswith("QSF"):
        return (33, 576), (9, 8256)
    return (33, 576), (7, 160), (9, 8256)


def rows_against_one(target: Target, w: WeightData, T: int, seed: int, **attrs) -> None:
    """x [T, K] through the rows kernel (``attrs``) against each row through
    the one-row kernel, on 1 and 3 threads."""
    n, k = (int(d) for d in w.type.shape)
    op_attrs = {} if w.type.layout == "F32" else {"layout": w.type.layout}
    op = "matmul" if w.type.layout == "F32" else "qmatmul"
    extra = {key: v for key, v in attrs.items() if key == "act"}
    one = kernel(sig_for(op, [TensorType((k,)), w.type], **op_attrs, **extra), target)
    rows = kernel(sig_for(op, [TensorType(("T", k)), w.type], **op_attrs, **attrs), target)
    x = (2 * np.random.default_rng(seed).standard_normal((T, k))).astype(np.float32)
    for nt in (1, 3):
        got = call(rows, [x, w], T, nt)
        for t in range(T):
            same_bits(got[t], call(one, [x[t], w], 1, nt), f"{w.type.layout} {n}x{k} row {t} of {T}, {nt} threads")


# --- float matmuls: decode rows (passes/int_dot marks them) -------------------------------------
FLOAT_LAYOUTS = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                 "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "QSF_Q8", "QSF_Q4", "QSF_Q2", "QSF_TERNARY", "TQ1_0", "TQ2_0",
                 *LUT]


@pytest.mark.parametrize("label", LABELS)
@pytest.mark.parametrize("layout", FLOAT_LAYOUTS)
def test_float_decode_rows(label: str, layout: str) -> None:
    target = variant(label)
    rng = np.random.default_rng(7)
    for n, k in shapes(layout):
        rows_against_one(target, float_weight(rng, layout, n, k), 6, n + k, decode_rows=4)


# --- the integer path: decode rows -----------------------------------------------------------------
INT_LAYOUTS = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K",
               "QSF_Q8", "QSF_Q4", "QSF_Q2", "QSF_Q2S", "QSF_TERNARY", "TQ1_0", "TQ2_0", *LUT]


@pytest.mark.parametrize("label", LABELS)
@pytest.mark.parametrize("layout", INT_LAYOUTS)
def test_int_decode_rows(label: str, layout: str) -> None:
    target = variant(label)
    rng = np.random.default_rng(8)
    act = quant_type(layout).act
    for n, k in shapes(layout):
        rows_against_one(target, float_weight(rng, layout, n, k), 6, n + k, act=act, decode_rows=4)


# --- repacked weights: every row count, the fused norm and the residual epilogue -------------------
def repacked_or_skip(target: Target, rng, base: str, n: int, k: int) -> WeightData:
    W = vnni_width(target.vector_width, target)
    if W is None:
        pytest.skip(f"no repacked weights on {target.cpu} without VNNI")
    return repacked(float_weight(rng, base, n, k), W)


@pytest.mark.parametrize("label", LABELS)
@pytest.mark.parametrize("base", REPACKABLE)
def test_repacked_every_row_count(label: str, base: str) -> None:
    """A decode step's row against the same row in a prompt chunk (more rows
    than a call quantizes at once) and in a batch of a few."""
    target = variant(label)
    rng = np.random.default_rng(9)
    act = "q8k" if base.endswith("_K") else "q8"
    for n, k in ((48, 1280), (32, 2048)):
        wr = repacked_or_skip(target, rng, base, n, k)
        one = kernel(sig_for("qmatmul", [TensorType((k,)), wr.type], layout=wr.type.layout, act=act), target)
        chunk = kernel(sig_for("qmatmul", [TensorType(("T", k)), wr.type], layout=wr.type.layout, act=act), target)
        x = rng.standard_normal((70, k)).astype(np.float32)
        for T, nt in ((70, 2), (3, 3)):
            got = call(chunk, [x[:T], wr], T, nt)
            for t in sorted({0, 1, T // 2, T - 1}):
                same_bits(got[t], call(one, [x[t], wr], 1, nt), f"{base} row {t} of {T}")


@pytest.mark.parametrize("label", LABELS)
@pytest.mark.parametrize("base", ["Q4_1", "Q5_0", "Q4_K", "Q6_K"])
def test_fused_norm_and_epilogue(label: str, base: str) -> None:
    """The rmsnorm kernel then the product (then the residual add) against
    the one kernel that does all of it (``fuse_norm``, ``fuse_residual``)."""
    target = variant(label)
    rng = np.random.default_rng(10)
    n, k = 48, 1280
    wr = repacked_or_skip(target, rng, base, n, k)
    act = "q8k" if base.endswith("_K") else "q8"
    x = (3 * rng.standard_normal((5, k))).astype(np.float32)
    r = rng.standard_normal((5, n)).astype(np.float32)
    g = (1 + 0.1 * rng.standard_normal(k)).astype(np.float32)
    gt = TensorType((k,))
    for shape, T in (((k,), 1), (("T", k), 5)):
        xs, rs = (x[0], r[0]) if T == 1 else (x, r)
        xn = call(kernel(sig_for("rmsnorm", [TensorType(shape), gt], eps=1e-6), target), [xs, g], T, 2)
        plain = call(kernel(sig_for("qmatmul", [TensorType(shape), wr.type], layout=wr.type.layout, act=act),
                            target), [xn, wr], T, 2)
        fused = sig_for("qmatmul", [TensorType(shape), wr.type, gt], layout=wr.type.layout, act=act, norm_eps=1e-6)
        added = sig_for("qmatmul_add", [TensorType(shape), wr.type, TensorType(rs.shape if T == 1 else ("T", n)), gt],
                        layout=wr.type.layout, act=act, norm_eps=1e-6)
        for nt in (1, 3):
            same_bits(call(kernel(fused, target), [xs, wr, g], T, nt), plain, f"fused norm, {T} rows")
            same_bits(call(kernel(added, target), [xs, wr, rs, g], T, nt), plain + rs, f"norm + epilogue, {T} rows")


# --- elementwise, norms, RoPE: a row of [T, D] against [D] -------------------------------------
@pytest.mark.parametrize("label", LABELS)
def test_rowwise_kernels(label: str) -> None:
    target = variant(label)
    rng = np.random.default_rng(11)
    for d in (100, 576, 1536):
        x = (3 * rng.standard_normal((7, d))).astype(np.float32)
        y = rng.standard_normal((7, d)).astype(np.float32)
        g = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
        cases = [("silu", [x], {}), ("gelu_tanh", [x], {}), ("add", [x, y], {}), ("mul", [x, y], {}),
                 ("softcap", [x], {"cap": 30.0}), ("glu", [x, y], {"activation": "silu"}),
                 ("glu", [x, y], {"activation": "gelu_tanh"}), ("rmsnorm", [x, g], {"eps": 1e-6})]
        for op, args, attrs in cases:
            def types(rows):
                shape = (d,) if rows is None else ("T", d)
                return [TensorType(shape)] + [TensorType((d,) if op == "rmsnorm" else shape)] * (len(args) - 1)
            rows_k = kernel(sig_for(op, types("T"), **attrs), target)
            one_k = kernel(sig_for(op, types(None), **attrs), target)
            for nt in (1, 3):
                got = call(rows_k, args, 7, nt)
                for t in range(7):
                    one_args = [a[t] for a in args] if op != "rmsnorm" else [x[t], g]
                    same_bits(got[t], call(one_k, one_args, 1, nt), f"{op} {attrs} d={d} row {t}")


@pytest.mark.parametrize("label", LABELS)
def test_rope_rows(label: str) -> None:
    """Row t of a chunk at pos, and a batch row at positions[t], against a
    decode step at pos + t."""
    target = variant(label)
    rng = np.random.default_rng(12)
    for hd, style in ((64, "neox"), (64, "interleaved"), (128, "neox")):
        n = 3 * hd
        attrs = dict(head_dim=hd, theta=10000.0, style=style)
        x = rng.standard_normal((6, n)).astype(np.float32)
        one = kernel(sig_for("rope", [f32(n), i32()], **attrs), target)
        chunk = kernel(sig_for("rope", [f32("T", n), i32()], **attrs), target)
        batch = kernel(sig_for("rope", [f32("T", n), i32("T")], **attrs), target)
        pos = 1000
        positions = (pos + np.arange(6)).astype(np.int32)[::-1].copy()
        for nt in (1, 3):
            got = call(chunk, [x, pos], 6, nt, pos=pos)
            got_b = call(batch, [x[::-1].copy(), positions], 6, nt)
            for t in range(6):
                want = call(one, [x[t], pos + t], 1, nt, pos=pos + t)
                same_bits(got[t], want, f"rope {style} hd={hd} chunk row {t}")
                same_bits(got_b[5 - t], want, f"rope {style} hd={hd} batch row {5 - t}")


# --- attention: a decode step, a prompt chunk's row, a paged batch row ------------------------------
def cache(kind: str, values: np.ndarray) -> np.ndarray:
    c = state_array(kv_cache_type(kind, values.shape[0], values.shape[1]))
    kv_codec.kv_store(c, np.arange(values.shape[0]), values)
    return c


@pytest.mark.parametrize("label", LABELS)
@pytest.mark.parametrize("kind", ["f32", "f16", "q8"])
def test_attention_rows(label: str, kind: str) -> None:
    target = variant(label)
    rng = np.random.default_rng(13)
    H, kvh, hd, S, bs = 9, 3, 64, 96, 16
    for window in (0, 20):
        attrs = dict(n_heads=H, n_kv_heads=kvh, head_dim=hd, scale=1.0 / math.sqrt(hd), window=window)
        kc = cache(kind, rng.standard_normal((S, kvh * hd)).astype(np.float32))
        vc = cache(kind, rng.standard_normal((S, kvh * hd)).astype(np.float32))
        ct = kv_cache_type(kind, S, kvh * hd)
        T, pos = 7, 50
        q = rng.standard_normal((T, H * hd)).astype(np.float32)
        one = kernel(sig_for("attention", [f32(H * hd), ct, ct, i32()], **attrs), target)
        chunk = kernel(sig_for("attention", [f32("T", H * hd), ct, ct, i32()], **attrs), target)
        paged = kernel(sig_for("attention_paged", [f32("T", H * hd), ct, ct, i32("T"), i32("T", S // bs)],
                               block_size=bs, **attrs), target)
        # identity block tables: pool row p holds position p, as the contiguous cache does
        positions = (pos + np.arange(T)).astype(np.int32)
        tables = np.tile(np.arange(S // bs, dtype=np.int32), (T, 1))
        for nt in (1, 3):
            got_c = call(chunk, [q, kc, vc, pos], T, nt, pos=pos)
            got_p = call(paged, [q, kc, vc, positions, tables], T, nt)
            for t in range(T):
                want = call(one, [q[t], kc, vc, pos + t], 1, nt, pos=pos + t)
                same_bits(got_c[t], want, f"attention {kind} window {window}: chunk row {t}")
                same_bits(got_p[t], want, f"attention {kind} window {window}: paged row {t}")


def test_variants_are_what_they_say() -> None:
    """The no-AVX-512 builds have 8 lanes and no AVX-512 feature; the
    variants keep the host's triple and drop only what they name."""
    host = host_target()
    if not (X86 and host.has("avx2") and host.has("fma")):
        pytest.skip(f"needs an x86 host with AVX2 and FMA, this is {host.cpu}")
    for label in ("x86-64-v3, no AVX-512", "haswell, no AVX-512 or VNNI"):
        t = variant(label)
        assert t.vector_width == 8 and not any(f.startswith("+avx512") for f in t.features.split(","))
        assert t.has("avx2") and t.has("fma") and t.triple == host.triple
    assert not variant("haswell, no AVX-512 or VNNI").has("avxvnni")
    assert vnni_width(8, variant("haswell, no AVX-512 or VNNI")) is None


def test_a_renamed_host_is_the_hosts_code() -> None:
    """What lets ``variant`` skip another name of the host's processor model:
    a matmul of several rows and an attention compile to the same assembly
    (read as ``lmc kernel --show asm`` reads it)."""
    from compiler.codegen.jit import emit_assembly
    from runtime.tools.kernel_lab import Params, Problem, build_case, kernel_sig

    host = host_target()
    names = next((n for n in SAME_MODEL if host.cpu in n), None)
    if names is None:
        pytest.skip(f"{host.cpu} has no other name in SAME_MODEL")
    for other in sorted(names - {host.cpu}):
        renamed = host.variant(other, ())
        for p in (Problem("qmatmul", 256, 512, batch=40, qtype="Q4_K"),
                  Problem("attention", 100, 256, batch=4, head_dim=64, kv_heads=2)):
            sig = kernel_sig(build_case(p, True), Params())
            asm = [emit_assembly(CompiledKernel(sig, target=t).module, t) for t in (host, renamed)]
            assert len(asm[0].splitlines()) > 200 and asm[0] == asm[1], (other, p.kind)


# --- AMX tiles against the VNNI code: the same integers, the same float operations -----------------
def amx_or_skip() -> Target:
    host = host_target()
    if not host.amx:
        why = amx_status()["why"] if X86 else f"an x86 CPU, and this host is {host.triple}"
        pytest.skip(f"AMX: {why}")
    return host


GEMM_LAYOUTS = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                "QSF_Q8", "QSF_Q4", "QSF_Q2", "QSF_Q2S", "QSF_TERNARY", "TQ1_0", "TQ2_0", *LUT]


@pytest.mark.parametrize("layout", GEMM_LAYOUTS)
def test_gemm_on_amx_tiles_gives_the_vnni_bits(layout: str) -> None:
    """A prompt chunk's GEMM on the file's layout: with AMX (from
    ``amx_tiles.MIN_TOKENS`` rows, 16 tokens a tile, the rows past the last
    whole 16 on the VNNI code; forced on for every type, whatever the traits
    table chooses) and without, every row the same bits, on 1 and 3 threads."""
    host = amx_or_skip()
    rng = np.random.default_rng(14)
    act = quant_type(layout).act
    for n, k in shapes(layout)[:2]:
        w = float_weight(rng, layout, (n + 15) // 16 * 16, k)
        sig = sig_for("qmatmul", [TensorType(("T", k)), w.type], layout=layout, act=act, gemm=48, amx=1)
        on, off = kernel(sig, host), kernel(sig, without_amx(host))
        x = (2 * rng.standard_normal((70, k))).astype(np.float32)
        for T, nt in ((70, 2), (47, 3), (32, 1), (2, 1)):
            same_bits(call(on, [x[:T], w], T, nt), call(off, [x[:T], w], T, nt), f"{layout} {T} rows, {nt} threads")


@pytest.mark.parametrize("base", REPACKABLE)
def test_repacked_on_amx_tiles_gives_the_vnni_bits(base: str) -> None:
    """Repacked weights (the runtime's for these types): a prompt chunk, a
    batch of a few rows, with AMX and without, and each row as a decode step."""
    host = amx_or_skip()
    rng = np.random.default_rng(15)
    act = quant_type(base).act
    n, k = 48, 1280
    wr = repacked(float_weight(rng, base, n, k), 16)
    sig = sig_for("qmatmul", [TensorType(("T", k)), wr.type], layout=base, act=act, amx=1)
    on, off = kernel(sig, host), kernel(sig, without_amx(host))
    one = kernel(sig_for("qmatmul", [TensorType((k,)), wr.type], layout=base, act=act), host)
    x = (2 * rng.standard_normal((70, k))).astype(np.float32)
    for T, nt in ((70, 2), (33, 3), (32, 1), (2, 1)):
        got = call(on, [x[:T], wr], T, nt)
        same_bits(got, call(off, [x[:T], wr], T, nt), f"{base} {T} rows, {nt} threads")
        for t in sorted({0, T - 1}):
            same_bits(got[t], call(one, [x[t], wr], 1, nt), f"{base} row {t} of {T} against a decode step")


def test_amx_where_the_table_says_and_the_target_has_it() -> None:
    """The traits table's ``amx`` chooses the tiles per type (Q4_0 yes,
    Q6_K no); ``LMC_AMX=0`` and a CPU or process without the tile state
    leave no AMX instruction in any kernel: the target has no AMX feature
    then."""
    from compiler.codegen.jit import emit_assembly
    from compiler.codegen.matmul.traits import traits_of

    host = amx_or_skip()
    assert not without_amx(host).amx
    assert traits_of("Q4_0").amx and not traits_of("Q6_K").amx
    for layout, want in (("Q4_0", True), ("Q6_K", False)):
        w = float_weight(np.random.default_rng(16), layout, 32, 256)
        sig = sig_for("qmatmul", [TensorType(("T", 256)), w.type], layout=layout, act=quant_type(layout).act, gemm=32)
        # tdpbsud or tdpbssd (symmetric layouts take their signed quants)
        assert ("tdpb" in emit_assembly(kernel(sig, host).module, host)) == want, layout
        assert "tdpb" not in emit_assembly(kernel(sig, without_amx(host)).module, without_amx(host))
