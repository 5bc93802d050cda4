"""The kernel lab (``lmc kernel``): one kernel compiled on its own, checked, timed and tuned.

A kind names a problem in the IR's ops: ``matvec`` / ``matmul`` are
``matmul`` with an F32 weight on one token / ``--batch`` tokens, ``qmatvec``
/ ``qmatmul`` the same with a stored ``--qtype`` weight, and ``rmsnorm``,
``rope``, ``attention``, ``softmax`` their ops. The kernel is the one the
compiler would emit for that node (``compiler.codegen``), specialised on the
shape, and the code generator's parameters -- vector width, unrolling, rows
and tokens per tile, integer or float dot product -- are options: each
becomes a kernel attribute the emitter reads, so a variant needs no edit.

Every run checks the kernel against the op's numpy reference in
``ir.ops`` on random data (quantized weights come from ``gguf.quants``, our
Q2_K / Q3_K / Q4_K writers, llama2.c's Q8 writer, or random blocks with
sane scales where no quantizer exists), then times it the way the runtime runs a step: N
threads, workers waiting in native code, a barrier after every call
(``compiler.codegen.harness.ThreadedKernel``). The median over batches of
calls (after warm-up) gives GB/s (bytes the op must read and write per call
over the time) and GFLOP/s, shown next to what this machine can do: its
read bandwidth and FMA peak, measured by compiled probes
(``compiler.codegen.probe``) with the same thread count.

A decode step reads every weight once, from memory. Unless ``--hot``, the
matrix kinds therefore rotate through equal copies of the weight that
together exceed the caches, so each call reads it from memory too.

Exit status: 0, or 1 when a kernel gave wrong numbers (``"correct": false``);
bad input is one line on stderr and 2, as everywhere in ``lmc``.
"""
from __future__ import annotations

import functools
import math
import os
import statistics
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np

from ir.int_dot import ACT_LAYOUTS, int_act
from ir.ops import WeightData
from ir.quant import ACT_BLOCK
from ir.switches import switch
from ir.types import TensorType, f32, i32, kv_cache_type

KINDS = ("matvec", "matmul", "qmatvec", "qmatmul", "rmsnorm", "rope", "attention", "softmax")
MATRIX_KINDS = ("matvec", "matmul", "qmatvec", "qmatmul")
Q_KINDS = ("qmatvec", "qmatmul")
VECTOR_WIDTHS = (4, 8, 16)
#: the rotated copies of a weight add up to at least this, or twice the
#: last-level cache where that is larger (``cold_bytes``), so no call finds
#: its weight in cache
COLD_BYTES = 256 << 20
#: operands larger than this are refused (the lab allocates them all)
MAX_BYTES = 4 << 30
#: the bandwidth probe's buffer: as COLD_BYTES, several times the caches
PROBE_BYTES = 256 << 20


@functools.cache
def cold_bytes() -> int:
    """COLD_BYTES, or twice the largest cache the kernel reports if that is
    more: some servers have last-level caches of hundreds of MiB (this
    project's CI machine reports 480 MiB), where 256 MiB of copies would be
    partly read from cache and overstate the memory bandwidth."""
    import glob

    llc = 0
    for f in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            s = open(f).read().strip().upper()
            shift = {"K": 10, "M": 20, "G": 30}.get(s[-1:], 0)
            llc = max(llc, int(s[:-1] if shift else s) << shift)
        except (OSError, ValueError, KeyError):
            continue
    return max(COLD_BYTES, 2 * llc)
PROBE_RUNS = 3
#: how long one timed batch of calls should take
BATCH_SECONDS = 0.004
DEFAULT_REPEATS = 15
SWEEP_REPEATS = 7
#: parameter name (kernel attribute) -> the option that sets it
FLAGS = {"vector_width": "--vector-width", "unroll": "--unroll", "rows": "rows per tile (--tile R)",
         "tile_tokens": "tokens per tile (--tile RxC)", "int_dot": "--int-dot/--float-dot",
         "prefetch": "--prefetch"}


class KernelLabError(ValueError):
    """Bad input to ``lmc kernel``: one line, exit 2."""


# --- what to run ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Params:
    """Code generator parameters; None is the compiler's own choice."""

    vector_width: int | None = None
    unroll: int | None = None
    rows: int | None = None          # rows per tile
    tile_tokens: int | None = None   # tokens per tile (matmul on a batch)
    int_dot: bool | None = None      # integer dot path (act="q8", or "q8k" on K-quants)
    prefetch: int | None = None      # bytes of weights asked for ahead (integer path; 0: none)

    def attrs(self) -> dict[str, int]:
        """The kernel attributes the emitters read."""
        return {k: v for k, v in (("unroll", self.unroll), ("rows", self.rows),
                                  ("tile_tokens", self.tile_tokens), ("prefetch", self.prefetch)) if v is not None}

    def given(self) -> list[str]:
        return [k for k in ("vector_width", "unroll", "rows", "tile_tokens", "int_dot", "prefetch")
                if getattr(self, k) is not None]


@dataclass(frozen=True)
class Problem:
    kind: str
    rows: int
    cols: int
    batch: int = 1
    qtype: str | None = None
    threads: int = 1
    head_dim: int | None = None
    kv_heads: int | None = None
    style: str = "interleaved"
    seed: int = 0
    hot: bool = False

    @property
    def layout(self) -> str:
        return self.qtype or "F32"


@dataclass
class Case:
    """One problem built: the op and operands, the reference, the cost."""

    op: str
    in_types: list[TensorType]
    attrs: dict[str, Any]
    args: list[Any]
    want: np.ndarray
    check: Callable[[np.ndarray], dict[str, Any]]
    bytes_read: int
    bytes_written: int
    flops: int
    T: int = 1
    pos: int = 0
    rotate: int | None = None       # input index of the weight
    copies: int = 1
    rotated: Any = None              # the copies, back to back
    notes: dict[str, Any] = field(default_factory=dict)


def parse_tile(s: str) -> tuple[int, int | None]:
    """``R`` (rows per tile) or ``RxC`` (rows x tokens per tile)."""
    parts = s.lower().split("x")
    try:
        vals = [int(p) for p in parts]
    except ValueError:
        vals = []
    if not 1 <= len(vals) <= 2 or any(v < 1 or v > 64 for v in vals):
        raise KernelLabError(f"--tile takes ROWS or ROWSxTOKENS between 1 and 64 (e.g. 4 or 4x4), not {s!r}")
    return vals[0], (vals[1] if len(vals) == 2 else None)


@functools.cache
def supported_layouts() -> tuple[str, ...]:
    """Weight layouts the native matmul reads (F32, F16, and every layout
    with a decoder; L2C_Q8G<g> stands for llama2.c's planar Q8 of any group)."""
    from compiler.codegen.matmul.traits import TRAITS
    from ir.quant import QUANT_TYPES
    from ir.quant.repack import REPACKABLE, repacked_name

    names = {name for name, tr in TRAITS.items() if tr.decoder is not None}
    ordered = [n for n in QUANT_TYPES if n in names] + sorted(names - set(QUANT_TYPES))   # the table's order
    # the runtime's repacked forms (integer path only)
    return tuple(ordered) + ("L2C_Q8G64",) + tuple(repacked_name(b, w) for b in REPACKABLE for w in (16, 8))


def _base(name: str) -> str:
    """The quant type of a --qtype as printed (``Q5_0x16`` -> ``Q5_0``)."""
    from ir.quant import split_stored

    return split_stored(name)[0]


def _layout(name: str):
    from ir.quant import get_layout

    try:
        return get_layout(name)
    except KeyError:
        return None


def default_int_dot(p: Problem) -> bool:
    """What the compiler does: the ``int_dot`` pass (in the default native
    pipeline where the host has VNNI) gives qmatmuls on 32-value block
    weights and K-quants the integer path, decode and prompt rows alike."""
    from compiler.pipeline import default_pipeline

    act = int_act(_base(p.qtype)) if p.qtype else None
    return (p.kind in Q_KINDS and act is not None and p.cols % ACT_BLOCK[act] == 0
            and "int_dot" in default_pipeline("llvm"))


def validate(p: Problem, prm: Params) -> None:
    """Everything that can be said before building anything; one line each."""
    from ir.quant.repack import split_repacked

    kind = p.kind
    if kind not in KINDS:
        raise KernelLabError(f"unknown kernel kind {kind!r} (one of {', '.join(KINDS)})")
    if p.rows < 1 or p.cols < 1 or p.batch < 1:
        raise KernelLabError("--rows, --cols and --batch must be >= 1")
    if kind in Q_KINDS:
        if p.qtype is None:
            raise KernelLabError(f"{kind} needs --qtype (one of {', '.join(supported_layouts())})")
        lay = _layout(p.qtype)
        if lay is None:
            raise KernelLabError(f"unknown --qtype {p.qtype!r} (supported: {', '.join(supported_layouts())})")
        if p.qtype not in supported_layouts() and not p.qtype.startswith("L2C_Q8G"):
            raise KernelLabError(f"--qtype {p.qtype} has no native matmul kernel "
                                 f"(supported: {', '.join(supported_layouts())})")
        if split_repacked(p.qtype):
            if not default_int_dot(p) or prm.int_dot is False:
                raise KernelLabError(f"--qtype {p.qtype} is read by the integer path only "
                                     "(a host with VNNI, without --float-dot)")
            if p.rows % split_repacked(p.qtype)[1]:
                raise KernelLabError(f"--rows {p.rows} is not a multiple of {p.qtype}'s "
                                     f"{split_repacked(p.qtype)[1]}-row tiles")
        block = getattr(lay, "block", 1)
        if p.cols % block:
            raise KernelLabError(f"--cols {p.cols} is not a multiple of {p.qtype}'s block of {block} values")
        group = getattr(lay, "group", None)
        if group and (p.rows * p.cols) % group:
            raise KernelLabError(f"{p.rows} x {p.cols} values are not whole groups of {group} ({p.qtype})")
    elif p.qtype is not None:
        raise KernelLabError(f"--qtype is for qmatvec/qmatmul; {kind} reads float32")
    if kind in ("matvec", "qmatvec") and p.batch != 1:
        raise KernelLabError(f"{kind} multiplies one token; use {kind.replace('vec', 'mul')} --batch {p.batch}")
    if kind in ("rmsnorm", "rope", "softmax") and p.batch != 1:
        raise KernelLabError(f"--batch does not apply to {kind} (--rows is the number of rows)")
    if kind == "attention" and p.batch > p.rows:
        raise KernelLabError(f"attention: {p.batch} query tokens (--batch) need a context (--rows) of at least "
                             f"{p.batch} positions")
    if kind not in ("rope", "attention") and p.head_dim is not None:
        raise KernelLabError(f"--head-dim is for rope and attention, not {kind}")
    if kind != "attention" and p.kv_heads is not None:
        raise KernelLabError(f"--kv-heads is for attention, not {kind}")
    if kind in ("rope", "attention"):
        hd = head_dim(p)
        if kind == "rope" and hd % 2:
            raise KernelLabError(f"rope: --head-dim {hd} must be even")
        if kind == "attention":
            heads = p.cols // hd
            kvh = p.kv_heads or heads
            if kvh < 1 or heads % kvh:
                raise KernelLabError(f"attention: --kv-heads {kvh} does not divide the {heads} query heads")
    if prm.vector_width is not None and prm.vector_width not in VECTOR_WIDTHS:
        raise KernelLabError(f"--vector-width must be one of {', '.join(map(str, VECTOR_WIDTHS))}")
    for name in ("unroll", "rows", "tile_tokens"):
        v = getattr(prm, name)
        if v is not None and not 1 <= v <= 64:
            raise KernelLabError(f"{FLAGS[name]}: {v} is not between 1 and 64")
    if prm.unroll is not None and kind == "rope":
        raise KernelLabError("--unroll does not apply to rope (its loop over a head is fully unrolled)")
    if (prm.rows is not None or prm.tile_tokens is not None) and kind not in MATRIX_KINDS:
        raise KernelLabError(f"--tile does not apply to {kind} (it tiles the rows and tokens of a matrix product)")
    if prm.tile_tokens is not None and kind in ("matvec", "qmatvec"):
        raise KernelLabError(f"{kind} has one token: --tile takes rows per tile only (e.g. --tile 4)")
    if prm.int_dot is not None:
        if kind not in Q_KINDS:
            raise KernelLabError(f"--int-dot/--float-dot are for qmatvec/qmatmul, not {kind}")
        act = int_act(_base(p.qtype))
        if prm.int_dot and act is None:
            names = "/".join(lay for lays in ACT_LAYOUTS.values() for lay in lays)
            raise KernelLabError(f"--int-dot needs a {names} weight, not {p.qtype}")
        if prm.int_dot and p.cols % ACT_BLOCK[act]:
            raise KernelLabError(f"--int-dot on {p.qtype} needs columns a multiple of {ACT_BLOCK[act]}")
    if prm.tile_tokens is not None and use_int_dot(p, prm):
        raise KernelLabError("--tile ROWSxTOKENS does not apply to the integer dot path (one token at a time)")
    nbytes = _operand_bytes(p)
    if nbytes > MAX_BYTES:
        raise KernelLabError(f"operands of {nbytes / 2**30:.1f} GiB are more than the lab's "
                             f"{MAX_BYTES / 2**30:.0f} GiB")


def head_dim(p: Problem) -> int:
    if p.head_dim is not None:
        hd = p.head_dim
    elif p.cols % 64 == 0:
        hd = 64
    else:
        raise KernelLabError(f"{p.kind}: --cols {p.cols} is not a multiple of 64; give --head-dim")
    if hd < 1 or p.cols % hd:
        raise KernelLabError(f"{p.kind}: --head-dim {hd} does not divide --cols {p.cols}")
    return hd


def use_int_dot(p: Problem, prm: Params) -> bool:
    return default_int_dot(p) if prm.int_dot is None else prm.int_dot


def _operand_bytes(p: Problem) -> int:
    if p.kind in MATRIX_KINDS:
        return p.rows * p.cols * 4 * 2 + p.batch * (p.rows + p.cols) * 4
    if p.kind == "attention":
        return p.rows * p.cols * 4 * 2 + p.batch * p.cols * 8
    return p.rows * p.cols * 8


# --- operands -----------------------------------------------------------------------------------
def make_weight(rng: np.random.Generator, layout: str, n: int, k: int) -> WeightData:
    """An [n, k] weight stored in ``layout``: normal values (sd 0.05, as in
    trained models) quantized by the format's own quantizer where we have
    one (gguf.quants, our Q2_K / Q3_K / Q4_K and llama2.c Q8 writers, a
    layout's own ``quantize`` such as QSF's); random quants with small
    positive and negative super-block scales otherwise (Q5_K, Q6_K)."""
    from frontends.quantize import quantizable
    from ir.quant import quant_type
    from ir.quant.repack import split_repacked

    if split_repacked(layout):   # the file layout's weight, repacked as the runtime does at load
        name, width = split_repacked(layout)
        base = make_weight(rng, name, n, k)
        raw = _layout(layout).repack(np.asarray(base.raw), n, k)
        return WeightData(raw, TensorType((n, k), "f32", name, width))
    t = TensorType((n, k), "f32", layout)
    data = (rng.standard_normal((n, k), dtype=np.float32) * np.float32(0.05))
    if layout == "F32":
        raw = data
    elif layout == "F16":
        raw = data.astype("<f2")
    elif quantizable(layout):   # GGUF types: gguf.quants or lmc's own writer (frontends.quantize)
        from frontends.quantize import quantize

        raw = quantize(data, layout).reshape(-1)
    elif layout.startswith("L2C_Q8G"):
        from frontends.llama2c_writer import quantize_q8

        q, s = quantize_q8(data.reshape(-1), int(layout[len("L2C_Q8G"):]))
        raw = np.concatenate([q.view(np.uint8), s.astype("<f4").view(np.uint8)])
    elif hasattr(_layout(layout), "quantize"):   # layouts with their own quantizer (QSF_*)
        raw = _layout(layout).quantize(data)
    else:
        lay = _layout(layout)
        nblocks = lay.nbytes(t.shape) // lay.block_bytes
        blocks = rng.integers(0, 256, size=(nblocks, lay.block_bytes), dtype=np.uint8)
        qt = quant_type(layout)
        for at in (qt.at(f) for f in ("d", "dmin") if qt.has(f)):   # the float16 super-block scales
            d = (rng.uniform(1e-5, 1e-3, nblocks) * rng.choice([-1.0, 1.0], nblocks)).astype("<f2")
            blocks[:, at:at + 2] = d.view(np.uint8).reshape(nblocks, 2)
        raw = blocks
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    return WeightData(raw, t)


def _act_type(rows: int, n: int) -> TensorType:
    """One row as a decode step has it ([n]); several as a prefill chunk ([T, n])."""
    return f32(n) if rows == 1 else f32("T", n)


def _dot_check(x: np.ndarray, w: WeightData, k: int) -> Callable[[np.ndarray, np.ndarray], dict[str, Any]]:
    """Correct to float32 rounding of a dot product: |err| within rtol of
    sum |x||w| (the terms' scale, which cancellation does not shrink)."""
    wf = np.abs(w.to_f32())
    scale = np.abs(np.asarray(x, np.float32)).reshape(-1, k) @ wf.T
    rtol = 1e-5 * max(1.0, math.sqrt(k / 4096))
    bound = rtol * scale.astype(np.float64) + 1e-30

    def check(got: np.ndarray, want: np.ndarray) -> dict[str, Any]:
        return _errors(got, want, bound.reshape(want.shape), f"|err| <= {rtol:.1e} * sum|x||w|")

    return check


def _close_check(rtol: float, atol: float) -> Callable[[np.ndarray, np.ndarray], dict[str, Any]]:
    def check(got: np.ndarray, want: np.ndarray) -> dict[str, Any]:
        scale = max(1.0, float(np.abs(want[np.isfinite(want)]).max(initial=0.0)))
        bound = atol * scale + rtol * np.abs(want.astype(np.float64))
        return _errors(got, want, bound, f"|err| <= {atol:g} * max(1, max|ref|) + {rtol:g} * |ref|")

    return check


def _errors(got: np.ndarray, want: np.ndarray, bound, rule: str) -> dict[str, Any]:
    g, w = got.astype(np.float64), want.astype(np.float64)
    same_nan = np.isnan(g) & np.isnan(w)
    err = np.where(same_nan, 0.0, np.abs(g - w))
    err = np.where(np.isnan(err), np.inf, err)
    peak = float(np.abs(w[np.isfinite(w)]).max(initial=0.0))
    max_err = float(err.max(initial=0.0))
    return {"correct": bool(got.shape == want.shape and np.all(err <= bound)),
            "max_abs_error": max_err,
            "rel_error": max_err / peak if peak > 0 else max_err,
            "tolerance": rule}


def build_case(p: Problem, int_dot: bool) -> Case:
    """Operands, reference and cost of ``p`` (data from ``p.seed``)."""
    from ir import ops

    rng = np.random.default_rng(p.seed)
    R, C, B = p.rows, p.cols, p.batch
    kind = p.kind
    if kind in MATRIX_KINDS:
        layout = p.layout
        w = make_weight(rng, layout, R, C)
        x = rng.standard_normal((B, C), dtype=np.float32)
        if kind in ("matvec", "qmatvec"):
            x = x[0]
        xt = f32(C) if x.ndim == 1 else f32("T", C)
        if kind in ("matvec", "matmul"):
            op, attrs, want = "matmul", {}, ops.matmul_ref(x, w)
        else:
            op, attrs = "qmatmul", {"layout": w.type.layout}
            if int_dot:
                attrs["act"] = int_act(w.type.layout)
                if kind == "qmatmul":   # prompt rows, as passes/int_dot marks them
                    from passes.int_dot import GEMM_ROWS

                    attrs["gemm"] = GEMM_ROWS      # a kernel choice: not the reference's
            want = ops.qmatmul_ref(x, w, **{k: v for k, v in attrs.items() if k != "gemm"})
        check = _dot_check(x, w, C)
        case = Case(op, [xt, w.type], attrs, [x, w], want, lambda g: check(g, want),
                    w.raw.nbytes + x.nbytes, want.nbytes, 2 * R * C * B, T=B)
        case.rotate = 1
        if not p.hot and w.raw.nbytes < cold_bytes():
            case.copies = -(-cold_bytes() // w.raw.nbytes)
        return case
    if kind == "rmsnorm":
        x = rng.standard_normal((R, C), dtype=np.float32) * np.float32(3.0)
        wv = (1.0 + 0.1 * rng.standard_normal(C)).astype(np.float32)
        w = WeightData(wv.view(np.uint8), TensorType((C,), "f32", "F32"))
        x = x[0] if R == 1 else x
        want = ops.rmsnorm_ref(x, w, eps=1e-5)
        check = _close_check(1e-5, 1e-5)
        return Case("rmsnorm", [_act_type(R, C), w.type], {"eps": 1e-5}, [x, w], want, lambda g: check(g, want),
                    x.nbytes + wv.nbytes, want.nbytes, 4 * R * C, T=R)
    if kind == "rope":
        hd = head_dim(p)
        pos = 100
        x = rng.standard_normal((R, C), dtype=np.float32)
        x = x[0] if R == 1 else x
        attrs = {"head_dim": hd, "theta": 10000.0, "style": p.style}
        want = ops.rope_ref(x, pos, **attrs)
        check = _close_check(0.0, 1e-5)
        case = Case("rope", [_act_type(R, C), i32()], attrs, [x, pos], want, lambda g: check(g, want),
                    x.nbytes, want.nbytes, 3 * R * C, T=R, pos=pos)
        case.notes = {"head_dim": hd, "style": p.style, "pos": pos}
        return case
    if kind == "softmax":
        x = rng.standard_normal((R, C), dtype=np.float32) * np.float32(4.0)
        x = x[0] if R == 1 else x
        want = ops.softmax_ref(x)
        check = _close_check(1e-5, 1e-7)
        return Case("softmax", [_act_type(R, C)], {}, [x], want, lambda g: check(g, want),
                    x.nbytes, want.nbytes, 5 * R * C, T=R)
    # attention: --rows positions of context, --cols = heads x head_dim, --batch query tokens
    hd = head_dim(p)
    H = C // hd
    kvh = p.kv_heads or H
    S, T = R, B
    pos = S - T
    q = rng.standard_normal((T, C), dtype=np.float32)
    q = q[0] if T == 1 else q
    # the caches in the default KV type (f16: what a model runs with unless told otherwise)
    kc = rng.standard_normal((S, kvh * hd), dtype=np.float32).astype(np.float16)
    vc = rng.standard_normal((S, kvh * hd), dtype=np.float32).astype(np.float16)
    attrs = {"n_heads": H, "n_kv_heads": kvh, "head_dim": hd, "scale": 1.0 / math.sqrt(hd), "window": 0}
    want = ops.attention_ref(q, kc, vc, pos, **attrs)
    check = _close_check(1e-4, 2e-5)
    if os.environ.get("LMC_ATTN_TILED"):   # A/B of the AMX bf16 prefill kernel (1) and the per-row one (0)
        attrs = dict(attrs, tiled=int(switch("LMC_ATTN_TILED")))
    from compiler.codegen import k_attention_tiled
    from compiler.codegen.target import host_target
    tgt = host_target()
    if (T >= k_attention_tiled.MIN_ROWS and int(attrs.get("tiled", k_attention_tiled.DEFAULT)) and tgt.amx
            and tgt.has("amx-bf16")):
        # the prefill kernel may take AMX bf16 tiles: Q, K, V and the weights rounded to bf16
        # (2^-9 relative each); with these N(0, 1) operands outputs err up to ~1e-2
        check = _close_check(2e-2, 2e-2)
    keys = sum(pos + t + 1 for t in range(T))
    cache_t = kv_cache_type("f16", S, kvh * hd)
    case = Case("attention", [_act_type(T, C), cache_t, cache_t, i32()], attrs,
                [q, kc, vc, pos], want, lambda g: check(g, want),
                q.nbytes + kc.nbytes + vc.nbytes, want.nbytes, H * (4 * hd + 5) * keys, T=T, pos=pos)
    case.notes = {"heads": H, "kv_heads": kvh, "head_dim": hd, "context": S, "pos": pos}
    return case


# --- compile, check, time -----------------------------------------------------------------------
def kernel_sig(case: Case, prm: Params):
    from compiler.codegen.harness import sig_for

    return sig_for(case.op, case.in_types, **case.attrs, **prm.attrs())


def _compile(case: Case, prm: Params, threads: int):
    from compiler.codegen.harness import ThreadedKernel

    try:
        return ThreadedKernel(kernel_sig(case, prm), prm.vector_width, threads,
                              rotate=case.rotate if case.copies > 1 else None)
    except NotImplementedError as e:
        raise KernelLabError(str(e)) from None


def _not_applied(prm: Params, tuning: dict[str, int], what: str) -> None:
    """A parameter the user set that the emitter did not use."""
    for name in ("unroll", "rows", "tile_tokens"):
        if getattr(prm, name) is not None and name not in tuning:
            raise KernelLabError(f"{FLAGS[name]} does not apply to {what}")


def _describe(p: Problem, int_dot: bool) -> str:
    if p.kind in Q_KINDS:
        return f"{p.kind} on {p.qtype}" + (" (integer dot path)" if int_dot else "")
    return p.kind


@dataclass
class Variant:
    params: Params
    vector_width: int
    int_dot: bool
    tuning: dict[str, int]
    check: dict[str, Any]
    median_s: float = float("nan")
    min_s: float = float("nan")
    reps: int = 0
    repeats: int = 0

    def effective(self) -> tuple:
        return (self.vector_width, self.int_dot, tuple(sorted(self.tuning.items())))


class _Running:
    """A compiled, checked variant, ready to time: ``batch()`` times one
    batch of ``reps`` calls (after one call that wakes the workers and
    warms the caches)."""

    def __init__(self, p: Problem, case: Case, prm: Params, int_dot: bool) -> None:
        from compiler.codegen.target import host_target

        self.case = case
        self.tk = tk = _compile(case, prm, p.threads)
        try:
            _not_applied(prm, tk.tuning, _describe(p, int_dot))
            self.out = np.full(case.want.shape, np.nan, np.float32)
            args = list(case.args)
            if case.copies > 1:
                args[case.rotate] = case.rotated
            tk.set_operands(self.out, args, pos=case.pos, T=case.T, copies=case.copies)
            tk.run(1)
            self.variant = Variant(prm, prm.vector_width or host_target().vector_width, int_dot, dict(tk.tuning),
                                   case.check(self.out))
            tk.run(1)                                           # warm: code, page tables
            # calibrate the calls per batch on the fastest of a few tries (on
            # a busy machine one try may wait for a descheduled worker)
            per_call, n = float("inf"), 1
            for attempt in range(16):
                per_call = min(per_call, tk.run(n) / n)
                short = n * per_call < BATCH_SECONDS / 4
                if (not short and attempt >= 2) or n >= 100_000:
                    break
                if short:
                    n *= 4
            self.reps = int(min(100_000, max(1, BATCH_SECONDS / max(per_call, 1e-9))))
            self.times: list[float] = []
        except BaseException:
            tk.close()
            raise

    def batch(self) -> None:
        self.tk.run(1)
        self.times.append(self.tk.run(self.reps) / self.reps)

    def close(self) -> None:
        self.tk.close()

    def finish(self) -> Variant:
        """The timed variant; checked again after all those threaded calls."""
        self.close()
        v = self.variant
        again = self.case.check(self.out)
        if not again["correct"]:
            v.check = again
        v.median_s, v.min_s = statistics.median(self.times), min(self.times)
        v.reps, v.repeats = self.reps, len(self.times)
        return v


def run_variant(p: Problem, case: Case, prm: Params, int_dot: bool, repeats: int) -> Variant:
    """Compile ``prm``'s kernel, check it on every thread, time it."""
    r = _Running(p, case, prm, int_dot)
    try:
        for _ in range(repeats):
            r.batch()
    except BaseException:
        r.close()
        raise
    return r.finish()


@functools.cache
def machine(threads: int) -> dict[str, Any]:
    """This machine's read bandwidth and FMA peak with ``threads`` threads
    (measured once per process). The bandwidth is the best of a few probe
    runs: what the machine can do, not what other work left of it."""
    from compiler.codegen.probe import measure_peak_gflops, measure_read_bandwidth
    from compiler.codegen.target import host_target

    t = host_target()
    bw = max(measure_read_bandwidth(threads, max(PROBE_BYTES, cold_bytes()), 3) for _ in range(PROBE_RUNS))
    return {"cpu": t.cpu, "vector_width": t.vector_width, "threads": threads,
            "read_gb_s": round(bw, 2), "peak_gflop_s": round(measure_peak_gflops(threads), 1)}


def _prepare(p: Problem, int_dot: bool, cache: dict) -> Case:
    """Cases by dot path (the reference differs); the rotated weight copies
    are made once."""
    if int_dot not in cache:
        case = build_case(p, int_dot)
        if case.copies > 1:
            other = next(iter(cache.values()), None)
            case.rotated = other.rotated if other is not None else np.tile(case.args[case.rotate].raw, case.copies)
        cache[int_dot] = case
    return cache[int_dot]


def _figures(case: Case, v: Variant, mach: dict[str, Any]) -> dict[str, Any]:
    moved = case.bytes_read + case.bytes_written
    gbs = moved / v.median_s / 1e9
    gfs = case.flops / v.median_s / 1e9
    return {"median_us": round(v.median_s * 1e6, 3), "min_us": round(v.min_s * 1e6, 3),
            "gb_s": round(gbs, 2), "gflop_s": round(gfs, 2),
            "bandwidth_share": round(gbs / mach["read_gb_s"], 3) if mach["read_gb_s"] else None,
            "peak_share": round(gfs / mach["peak_gflop_s"], 3) if mach["peak_gflop_s"] else None}


def _params_json(v: Variant, case: Case) -> dict[str, Any]:
    d: dict[str, Any] = {"vector_width": v.vector_width}
    d.update((k, v.tuning[k]) for k in ("rows", "tile_tokens", "unroll") if k in v.tuning)
    if case.op == "qmatmul":
        d["dot"] = "int" if v.int_dot else "float"
    return d


def _header(p: Problem, case: Case) -> dict[str, Any]:
    d: dict[str, Any] = {"kind": p.kind, "op": case.op, "rows": p.rows, "cols": p.cols, "batch": p.batch,
                         "threads": p.threads}
    if p.qtype:
        d["qtype"] = p.qtype
    d.update(case.notes)
    d.update({"bytes_read": case.bytes_read, "bytes_written": case.bytes_written, "flops": case.flops})
    if case.rotate is not None:
        d["weights"] = "cold" if case.copies > 1 else "hot"
        d["weight_copies"] = case.copies
    return d


def lab(p: Problem, prm: Params, repeats: int = DEFAULT_REPEATS) -> dict[str, Any]:
    """One variant: the JSON object ``lmc kernel --json`` prints."""
    validate(p, prm)
    int_dot = use_int_dot(p, prm)
    cases: dict = {}
    case = _prepare(p, int_dot, cases)
    v = run_variant(p, case, prm, int_dot, repeats)
    mach = machine(p.threads)
    return {**_header(p, case), "params": _params_json(v, case), **v.check, **_figures(case, v, mach),
            "reps": v.reps, "repeats": v.repeats, "machine": mach}


def sweep_grid(p: Problem, prm: Params) -> list[Params]:
    """A small grid around the defaults; options given on the command line
    stay fixed."""
    from compiler.codegen.target import host_target

    host = host_target().vector_width
    widths = [prm.vector_width] if prm.vector_width else sorted({host, max(4, host // 2)}, reverse=True)
    dots: list[bool | None] = [None]
    if p.kind in Q_KINDS:
        dots = [prm.int_dot] if prm.int_dot is not None else (
            [False, True] if p.qtype and int_act(_base(p.qtype)) else [None])
    grid = [Params()]  # the compiler's own choice first
    for vw in widths:
        for dot in dots:
            int_path = use_int_dot(p, replace(prm, int_dot=dot))
            if p.kind in ("matvec", "qmatvec"):
                unrolls, tiles = ((1, 2, 4) if int_path else (1, 2, 4, 8)), [(r, None) for r in (1, 2, 4)]
            elif p.kind in ("matmul", "qmatmul"):
                unrolls = (1, 2, 4) if int_path else (1, 2)
                tiles = [(r, None) for r in (1, 2, 4)] if int_path else [(2, 2), (3, 3), (4, 4), (4, 2), (2, 4)]
            elif p.kind == "attention":
                unrolls, tiles = (4, 8, 16), [(None, None)]
            elif p.kind == "rope":
                unrolls, tiles = (None,), [(None, None)]
            else:
                unrolls, tiles = (1, 2, 4, 8), [(None, None)]
            if prm.unroll is not None:
                unrolls = (prm.unroll,)
            if prm.rows is not None:
                tiles = [(prm.rows, prm.tile_tokens)]
            for u in unrolls:
                for r, c in tiles:
                    grid.append(Params(vw, u, r, c, dot))
    return grid


def sweep(p: Problem, prm: Params, repeats: int = SWEEP_REPEATS,
          progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every variant of the grid that compiles: checked and timed; the best
    is the fastest correct one. The timed batches are interleaved (a round
    times each variant once), so a noisy spell on the machine slows every
    variant alike instead of making one look bad."""
    validate(p, prm)
    cases: dict = {}
    mach = machine(p.threads)
    grid = sweep_grid(p, prm)
    running: list[_Running] = []
    seen: set[tuple] = set()
    default_key = None
    try:
        for i, q in enumerate(grid):
            try:
                validate(p, q)
            except KernelLabError:
                continue
            int_dot = use_int_dot(p, q)
            case = _prepare(p, int_dot, cases)
            if progress:
                progress(f"compiling {i + 1}/{len(grid)}")
            try:
                r = _Running(p, case, q, int_dot)
            except KernelLabError:
                continue  # a combination this kernel cannot build
            key = r.variant.effective()
            if i == 0:
                default_key = key
            if key in seen:
                r.close()
                continue
            seen.add(key)
            running.append(r)
        for k in range(repeats):
            if progress:
                progress(f"timing round {k + 1}/{repeats}")
            for r in running:
                r.batch()
    except BaseException:
        for r in running:
            r.close()
        raise
    rows: list[dict[str, Any]] = []
    for r in running:
        v = r.finish()
        rows.append({"params": _params_json(v, r.case), "default": v.effective() == default_key, **v.check,
                     **_figures(r.case, v, mach), "flags": _flags(v, r.case)})
    good = [r for r in rows if r["correct"]]
    best = min(good, key=lambda r: r["median_us"]) if good else None
    default = next((r for r in rows if r["default"]), None)
    case = next(iter(cases.values()))
    return {**_header(p, case), "sweep": rows, "best": best,
            "speedup_over_default": round(default["median_us"] / best["median_us"], 3) if best and default else None,
            "all_correct": all(r["correct"] for r in rows), "repeats": repeats, "machine": mach}


def _flags(v: Variant, case: Case) -> str:
    """The options that reproduce a variant."""
    f = [f"--vector-width {v.vector_width}"]
    t = v.tuning
    if "unroll" in t:
        f.append(f"--unroll {t['unroll']}")
    if "rows" in t:
        f.append(f"--tile {t['rows']}" + (f"x{t['tile_tokens']}" if "tile_tokens" in t else ""))
    if int_act(case.attrs.get("layout")):
        f.append("--int-dot" if v.int_dot else "--float-dot")
    return " ".join(f)


def show(p: Problem, prm: Params, what: str) -> str:
    """The kernel's LLVM IR (as emitted, before optimisation) or its
    optimised assembly for the host."""
    from compiler.codegen.harness import CompiledKernel
    from compiler.codegen.jit import emit_assembly

    validate(p, prm)
    case = build_case(replace(p, hot=True), use_int_dot(p, prm))
    try:
        ck = CompiledKernel(kernel_sig(case, prm), prm.vector_width)
    except NotImplementedError as e:
        raise KernelLabError(str(e)) from None
    return str(ck.module) if what == "ir" else emit_assembly(ck.module)


# --- text ------------------------------------------------------------------------------------------
def _si(n: float, unit: str) -> str:
    for scale, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {prefix}{unit}"
    return f"{n:.0f} {unit}"


def _title(r: dict[str, Any]) -> str:
    what = r["kind"] + (f" {r['qtype']}" if "qtype" in r else "")
    s = f"lmc kernel {what}  [{r['rows']} x {r['cols']}]"
    if r["kind"] in ("matmul", "qmatmul", "attention"):
        s += f"  batch {r['batch']}"
    s += f"  {r['threads']} thread{'s' if r['threads'] > 1 else ''}"
    if "weights" in r:
        s += f"  weights {r['weights']}" + (f" ({r['weight_copies']} copies rotated)" if r["weight_copies"] > 1 else "")
    extra = [f"{k} {r[k]}" for k in ("heads", "kv_heads", "head_dim", "context", "pos", "style") if k in r]
    return s + ("\n  " + ", ".join(extra) if extra else "")


def _param_text(params: dict[str, Any]) -> str:
    return "  ".join(f"{k}={v}" for k, v in params.items())


def format_text(r: dict[str, Any]) -> str:
    m = r["machine"]
    moved = r["bytes_read"] + r["bytes_written"]
    lines = [
        _title(r),
        f"  params     {_param_text(r['params'])}",
        f"  check      {'correct' if r['correct'] else 'WRONG'}   max abs error {r['max_abs_error']:.3g}   "
        f"relative {r['rel_error']:.3g}   ({r['tolerance']})",
        f"  time       {r['median_us']:.2f} us median   ({r['min_us']:.2f} min; {r['repeats']} batches of "
        f"{r['reps']} calls)",
        "",
        f"  {'':10} {'per call':>12} {'achieved':>14} {'machine':>14} {'share':>7}",
        f"  {'memory':10} {_si(moved, 'B'):>12} {r['gb_s']:>9.2f} GB/s {m['read_gb_s']:>9.2f} GB/s "
        f"{_pct(r['bandwidth_share']):>7}",
        f"  {'compute':10} {_si(r['flops'], 'FLOP'):>12} {r['gflop_s']:>6.2f} GFLOP/s {m['peak_gflop_s']:>6.1f} GFLOP/s "
        f"{_pct(r['peak_share']):>7}",
        f"  (machine: {m['cpu']}, read bandwidth and FMA peak measured with {m['threads']} "
        f"thread{'s' if m['threads'] > 1 else ''}, vector width {m['vector_width']})",
    ]
    return "\n".join(lines) + "\n"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def format_sweep(r: dict[str, Any]) -> str:
    m = r["machine"]
    keys: list[str] = []
    for row in r["sweep"]:
        for k in row["params"]:
            if k not in keys:
                keys.append(k)
    width = {k: max(5, len(k)) for k in keys}
    head = "  ".join(f"{k:>{width[k]}}" for k in keys)
    lines = [_title(r),
             f"  machine: read {m['read_gb_s']:.2f} GB/s, peak {m['peak_gflop_s']:.1f} GFLOP/s "
             f"({m['threads']} thread{'s' if m['threads'] > 1 else ''}); times: median of {r['repeats']} "
             f"rounds, each timing every variant once", "",
             f"  {head}  {'median us':>10}  {'GB/s':>8}  {'GFLOP/s':>8}  {'max err':>9}  correct"]
    for row in r["sweep"]:
        vals = "  ".join(f"{row['params'].get(k, '-')!s:>{width[k]}}" for k in keys)
        lines.append(f"  {vals}  {row['median_us']:>10.2f}  {row['gb_s']:>8.2f}  {row['gflop_s']:>8.2f}  "
                     f"{row['max_abs_error']:>9.2g}  {'yes' if row['correct'] else 'NO':<4}"
                     f"{'  <- default' if row['default'] else ''}".rstrip())
    b = r["best"]
    lines.append("")
    if b is None:
        lines.append("best: none (no variant was correct)")
    else:
        sp = r["speedup_over_default"]
        lines.append(f"best: {b['flags']}  {b['median_us']:.2f} us  {b['gb_s']:.2f} GB/s  "
                     f"{b['gflop_s']:.2f} GFLOP/s" + (f"  ({sp:.2f}x the default)" if sp else ""))
    if not r["all_correct"]:
        lines.append("some variants gave WRONG results (see the correct column)")
    return "\n".join(lines) + "\n"
