"""The op registry: each op has a shape rule and one numpy reference.

The references are the semantics of the IR. ``ir.interp`` runs graphs with
them, and every pass and compiled kernel is checked against them. They work
in float32 like the C programs we compare with (llama2.c's run.c), so the
interpreter reproduces their token choices.

Conventions: activations are ``[..., features]`` (a decode step has no
leading axis, a prefill chunk has a leading ``T``); a weight matrix is stored
``[out, in]`` row-major as in the model files, so ``matmul(x, W) = x @ W.T``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .int_dot import ACT_LAYOUTS, QK8, qmatmul_int_ref, quantize_q8_rows
from .quant import ACT_BLOCK, layout_of, quant_type
from .types import Dim, TensorType


class ShapeError(ValueError):
    """An op was applied to values whose types do not fit its rule."""


@dataclass
class WeightData:
    """A weight as the interpreter sees it: its raw stored bytes and type."""

    raw: np.ndarray  # uint8, usually a read-only memory map
    type: TensorType

    def to_f32(self) -> np.ndarray:
        shape = tuple(int(d) for d in self.type.shape)
        return layout_of(self.type).dequantize(self.raw, shape)

    def rows(self, idx: np.ndarray) -> np.ndarray:
        shape = tuple(int(d) for d in self.type.shape)
        return layout_of(self.type).dequantize_rows(self.raw, shape, idx)


def unrepacked(w: WeightData) -> WeightData:
    """A repacked weight (``ir/quant/repack.py``) as its file layout's bytes."""
    rows, cols = int(w.type.shape[0]), int(w.type.shape[1])
    raw = layout_of(w.type).unrepack(np.asarray(w.raw), rows, cols)
    return WeightData(raw, TensorType(w.type.shape, w.type.dtype, w.type.layout))


def f32_of(x: Any) -> np.ndarray:
    """The float32 numbers behind an operand (weights are dequantized)."""
    if isinstance(x, WeightData):
        return x.to_f32()
    return np.asarray(x, dtype=np.float32)


@dataclass(frozen=True)
class OpDef:
    name: str
    infer: Callable[[list[TensorType], dict[str, Any]], TensorType]
    ref: Callable[..., np.ndarray]
    n_inputs: int            # -1: the shape rule checks the count
    #: True when the op writes into its first (state) operand and returns it.
    updates_state: bool = False
    elementwise: bool = False
    #: index of an (optional) input whose buffer the output takes over: the
    #: op fills part of it in place (the arena planner gives both one offset)
    inplace: int | None = None


OPS: dict[str, OpDef] = {}


def register(name: str, n_inputs: int, infer: Callable[[list[TensorType], dict[str, Any]], TensorType],
             updates_state: bool = False, elementwise: bool = False, inplace: int | None = None):
    def deco(fn: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
        OPS[name] = OpDef(name, infer, fn, n_inputs, updates_state, elementwise, inplace)
        return fn

    return deco


def get_op(name: str) -> OpDef:
    try:
        return OPS[name]
    except KeyError:
        raise ShapeError(f"unknown op {name!r}") from None


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ShapeError(msg)


def _same_dim(a: Dim, b: Dim) -> bool:
    return a == b


# --- shape rules --------------------------------------------------------------
def _same_as_first(ts: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    return TensorType(ts[0].shape, "f32")


def _binary(ts: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    a, b = ts
    _need(a.shape == b.shape, f"shapes differ: {a} and {b}")
    return TensorType(a.shape, "f32")


def _bias(ts: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    a, b = ts
    _need(b.rank == 1 and a.shape[-1] == b.shape[0], f"bias {b} does not fit {a}")
    return TensorType(a.shape, "f32")


def _embedding(ts: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    w, ids = ts
    _need(w.rank == 2, f"embedding table must be 2-D, got {w}")
    _need(ids.dtype == "i32", f"token ids must be i32, got {ids}")
    return TensorType(ids.shape + (w.shape[1],), "f32")


def _matmul(ts: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    x, w = ts
    _need(w.rank == 2, f"weight must be 2-D, got {w}")
    _need(x.rank >= 1 and _same_dim(x.shape[-1], w.shape[1]), f"matmul: {x} does not fit weight {w}")
    if "layout" in attrs:
        _need(w.layout == attrs["layout"], f"qmatmul[{attrs['layout']}] on a {w.layout} weight")
    act = attrs.get("act")
    if act is not None:
        _need(act in ACT_LAYOUTS, f"qmatmul: unknown activation quantization act={act!r}")
        layouts, block = ACT_LAYOUTS[act], ACT_BLOCK[act]
        _need(w.layout in layouts,
              f"qmatmul act={act} needs a {'/'.join(layouts)} weight, got {w.layout}")
        _need(isinstance(w.shape[1], int) and w.shape[1] % block == 0,
              f"qmatmul act={act}: row length {w.shape[1]} is not a multiple of {block}")
    return TensorType(x.shape[:-1] + (w.shape[0],), "f32")


def _dequant(ts: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    (w,) = ts
    _need(w.layout is not None, "dequant needs a stored weight")
    return TensorType(w.shape, "f32")


def _rmsnorm(ts: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    x, w = ts
    _need(w.rank == 1, f"norm weight must be 1-D, got {w}")
    n = x.shape[-1]
    _need(isinstance(n, int) and n % int(w.shape[0]) == 0, f"rmsnorm: {w} does not divide {x}")
    return TensorType(x.shape, "f32")


def _rope(ts: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    _need(len(ts) in (2, 3), f"rope takes x, pos and optionally frequency factors, got {len(ts)} operands")
    x, pos = ts[0], ts[1]
    hd = attrs["head_dim"]
    _need(int(x.shape[-1]) % hd == 0 and hd % 2 == 0, f"rope: head_dim {hd} does not fit {x}")
    _need(attrs.get("style") in ("interleaved", "neox"), f"rope: unknown style {attrs.get('style')!r}")
    _need(pos.dtype == "i32" and (pos.rank == 0 or (pos.rank == 1 and x.rank == 2 and pos.shape[0] == x.shape[0])),
          f"rope: pos must be an i32 scalar or one i32 position per row of {x}, got {pos}")
    if len(ts) == 3:
        ff = ts[2]
        _need(ff.rank == 1 and (ff.layout or "F32") == "F32", f"rope: frequency factors must be F32, got {ff}")
    _need(float(attrs.get("freq_scale", 1.0)) > 0, "rope: freq_scale must be positive")
    rot = attrs.get("dims") or hd
    _need(isinstance(rot, int) and 0 < rot <= hd and rot % 2 == 0, f"rope: dims {rot} must be even, 1..{hd}")
    if len(ts) == 3:
        _need(ts[2].shape[0] == rot // 2, f"rope: {rot // 2} frequency factors needed, got {ts[2]}")
    return TensorType(x.shape, "f32")


def _kv_write(ts: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    cache, x, pos = ts
    _need(cache.rank == 2 and x.shape[-1] == cache.shape[1], f"kv_write: {x} does not fit cache {cache}")
    _kv_cache_ok(cache, "kv_write")
    return cache


def _attention(ts: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    q, kc, vc, pos = ts
    h, kvh, hd = attrs["n_heads"], attrs["n_kv_heads"], attrs["head_dim"]
    _need(q.shape[-1] == h * hd, f"attention: {q} is not {h} heads of {hd}")
    _need(kc == vc and kc.shape[-1] == kvh * hd, f"attention: caches {kc}, {vc} do not fit")
    _kv_cache_ok(kc, "attention")
    _need(kc.layout is None or hd % QK8 == 0, f"attention: a {kc.layout} cache needs head_dim a multiple of {QK8}")
    _need(h % kvh == 0, f"attention: {h} query heads not a multiple of {kvh} kv heads")
    return TensorType(q.shape, "f32")


def _paged_operands(ts: list[TensorType], rows: Dim, attrs: dict[str, Any], what: str) -> None:
    """``positions[T]`` and ``block_tables[T, MAXB]`` (i32) for ``rows`` rows,
    and a pool (the cache, first of ``ts``) of whole blocks."""
    pool, positions, tables = ts
    bs = attrs.get("block_size")
    _need(isinstance(bs, int) and bs > 0, f"{what}: block_size must be a positive int, got {bs!r}")
    _need(isinstance(pool.shape[0], int) and pool.shape[0] % bs == 0,
          f"{what}: a pool of {pool.shape[0]} rows is not whole blocks of {bs}")
    _need(positions.dtype == "i32" and positions.rank == 1 and positions.shape[0] == rows,
          f"{what}: positions must be i32[{rows}], got {positions}")
    _need(tables.dtype == "i32" and tables.rank == 2 and tables.shape[0] == rows and isinstance(tables.shape[1], int),
          f"{what}: block tables must be i32[{rows}, blocks], got {tables}")


def _kv_write_paged(ts: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    cache, x, positions, tables = ts
    _need(cache.rank == 2 and x.rank == 2 and x.shape[-1] == cache.shape[1],
          f"kv_write_paged: {x} does not fit pool {cache}")
    _kv_cache_ok(cache, "kv_write_paged")
    _paged_operands([cache, positions, tables], x.shape[0], attrs, "kv_write_paged")
    return cache


def _rope_kv_fits(cache: TensorType, attrs: dict[str, Any], what: str) -> None:
    """A q8 cache row is blocks of 32: the fused kernel rotates a head, then
    quantizes it, so each head must be whole blocks."""
    _need(cache.layout != "Q8_0" or int(attrs["head_dim"]) % QK8 == 0,
          f"{what}: a Q8_0 cache needs head_dim a multiple of {QK8}")


def _rope_kv_write(ts: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    _need(len(ts) in (3, 4), f"rope_kv_write takes cache, x, pos and optionally frequency factors, got {len(ts)}")
    cache, x, pos = ts[:3]
    _need(pos.rank == 0, f"rope_kv_write: pos must be an i32 scalar, got {pos}")
    rotated = _rope([x, pos, *ts[3:]], attrs)
    _rope_kv_fits(cache, attrs, "rope_kv_write")
    return _kv_write([cache, rotated, pos], {})


def _rope_kv_write_paged(ts: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    _need(len(ts) in (4, 5), f"rope_kv_write_paged takes pool, x, positions, tables and optionally frequency "
                             f"factors, got {len(ts)}")
    cache, x, positions, tables = ts[:4]
    rope = {k: v for k, v in attrs.items() if k != "block_size"}
    rotated = _rope([x, positions, *ts[4:]], rope)
    _rope_kv_fits(cache, attrs, "rope_kv_write_paged")
    return _kv_write_paged([cache, rotated, positions, tables], {"block_size": attrs.get("block_size")})


def _attention_paged(ts: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    q, kc, vc, positions, tables = ts
    _need(q.rank == 2, f"attention_paged: queries must be [T, heads x head_dim], got {q}")
    out = _attention([q, kc, vc, TensorType((), "i32")], attrs)
    _paged_operands([kc, positions, tables], q.shape[0], attrs, "attention_paged")
    return out


def _kv_cache_ok(t: TensorType, what: str) -> None:
    """KV cache storage: f32 or f16 values, or Q8_0 blocks (ir.types.KV_TYPES)."""
    if t.layout is None:
        _need(t.dtype in ("f32", "f16"), f"{what}: a KV cache of {t.dtype} is not supported (f32, f16, Q8_0)")
    else:
        _need(t.layout == "Q8_0" and isinstance(t.shape[1], int) and t.shape[1] % QK8 == 0,
              f"{what}: a KV cache {t} is not supported (f32, f16, or Q8_0 rows of whole blocks)")


def _take_last(ts: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    (x,) = ts
    _need(x.rank == 2, f"take_last needs [T, n], got {x}")
    return TensorType(x.shape[1:], "f32")


def _take_rows(ts: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    x, rows = ts
    _need(x.rank == 2, f"take_rows needs [T, n], got {x}")
    _need(rows.rank == 1 and rows.dtype == "i32" and isinstance(rows.shape[0], int),
          f"take_rows needs a fixed number of i32 row indices, got {rows}")
    return TensorType((rows.shape[0], x.shape[1]), "f32")


# --- references -----------------------------------------------------------------
@register("embedding", 2, _embedding)
def embedding_ref(w: WeightData, ids: np.ndarray) -> np.ndarray:
    ids = np.asarray(ids, dtype=np.int64)
    vocab = int(w.type.shape[0])
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise IndexError(f"token id out of range [0, {vocab})")
    return w.rows(ids.reshape(-1)).reshape(ids.shape + (int(w.type.shape[1]),))


@register("rmsnorm", 2, _rmsnorm)
def rmsnorm_ref(x: np.ndarray, w: Any, *, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * w, over chunks the size of w (whole rows,
    or each head for per-head Q/K norms). Float32 throughout, as run.c."""
    wv = f32_of(w)
    n = wv.shape[0]
    xs = np.asarray(x, np.float32).reshape(-1, n)
    ss = np.float32(1.0) / np.sqrt(np.mean(xs * xs, axis=1, dtype=np.float32) + np.float32(eps))
    return (wv * (xs * ss[:, None])).astype(np.float32).reshape(np.shape(x))


@register("matmul", 2, _matmul)
def matmul_ref(x: np.ndarray, w: Any) -> np.ndarray:
    """x @ w.T."""
    return np.asarray(x, np.float32) @ f32_of(w).T


@register("dequant", 1, _dequant)
def dequant_ref(w: WeightData) -> np.ndarray:
    return w.to_f32()


def _without_norm(ts: list[TensorType], attrs: dict[str, Any], n: int, op: str) -> list[TensorType]:
    """The operands of a quantized matmul but a fused RMSNorm's weight
    (``norm_eps``, ``passes/fuse_norm``: then the last of n + 1, one value per
    column of x); checks it."""
    if "norm_eps" not in attrs:
        _need(len(ts) == n, f"{op} takes {n} operands, got {len(ts)}")
        return ts
    _need(len(ts) == n + 1, f"{op} with norm_eps takes {n} operands and the norm weight, got {len(ts)}")
    x, nw = ts[0], ts[-1]
    _need(nw.rank == 1 and _same_dim(nw.shape[0], x.shape[-1]),
          f"{op}: norm weight {nw} does not span the rows of {x}")
    _need(isinstance(attrs["norm_eps"], float), f"{op}: norm_eps={attrs['norm_eps']!r} is not a float")
    return ts[:-1]


def _qmatmul(ts: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    return _matmul(_without_norm(ts, attrs, 2, "qmatmul"), attrs)


@register("qmatmul", -1, _qmatmul)
def qmatmul_ref(x: np.ndarray, w: WeightData, nw: Any = None, *, layout: str, act: str | None = None,
                norm_eps: float | None = None) -> np.ndarray:
    """matmul with a stored (quantized) weight; the reference dequantizes.
    With ``norm_eps``, x is first ``rmsnorm(x, nw)`` (``passes/fuse_norm``).

    With ``act`` ("q8", "q8k") the integer path's numbers (``ir.int_dot``):
    x quantized per block, integer dot products with the weight's quants."""
    if norm_eps is not None:
        x = rmsnorm_ref(x, nw, eps=norm_eps)
    if w.type.repack:   # the same numbers as the file's layout (ir/quant/repack.py)
        w = unrepacked(w)
    if act is None:
        return np.asarray(x, np.float32) @ w.to_f32().T
    return qmatmul_int_ref(x, w, act)


def _matmul_rows(ts: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    x, w = ts[:2]
    part = _matmul([x, w], attrs)
    row0, total = attrs.get("row0"), attrs.get("n_total")
    _need(isinstance(row0, int) and isinstance(total, int) and 0 <= row0 and row0 + w.shape[0] <= total,
          f"qmatmul_rows: rows {row0}+{w.shape[0]} do not fit a result of {total}")
    out = TensorType(part.shape[:-1] + (total,), "f32")
    if len(ts) == 3:
        _need(ts[2] == out, f"qmatmul_rows: accumulator {ts[2]} is not {out}")
    return out


@register("qmatmul_rows", -1, _matmul_rows, inplace=2)
def qmatmul_rows_ref(x: np.ndarray, w: WeightData, acc: np.ndarray | None = None, *, layout: str,
                     row0: int, n_total: int, act: str | None = None) -> np.ndarray:
    """One row block of a split ``qmatmul`` (``passes/split_rows``): rows
    [row0, row0 + n) of the full [.., n_total] result, written into ``acc``
    (the blocks before it) in place; rows not written yet are zero."""
    part = qmatmul_ref(x, w, layout=layout, act=act)
    out = np.zeros(part.shape[:-1] + (n_total,), np.float32) if acc is None else np.array(acc, np.float32)
    out[..., row0: row0 + part.shape[-1]] = part
    return out



def _matmul_add(ts: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    ts = _without_norm(ts, attrs, 3, "qmatmul_add (x, weight, addend)")
    out = _matmul(ts[:2], attrs)
    r = ts[2]
    _need(r == out or (r.rank == 1 and r.dtype == "f32" and (r.layout or "F32") == "F32"
                       and _same_dim(r.shape[0], out.shape[-1])),
          f"qmatmul_add: {r} is neither the product's {out} nor a bias of its rows")
    return out


@register("qmatmul_add", -1, _matmul_add)
def qmatmul_add_ref(x: np.ndarray, w: WeightData, r: Any, nw: Any = None, **attrs: Any) -> np.ndarray:
    """``add(r, qmatmul(x, w))`` or ``bias_add(qmatmul(x, w), r)`` as one op
    (``passes/fuse_residual``): the product, then the residual (or the bias,
    added to every row) as its epilogue; float32 addition commutes, so the
    bits are the two ops'. ``nw``: as qmatmul's."""
    return (qmatmul_ref(x, w, nw, **attrs) + f32_of(r)).astype(np.float32)

#: attributes of ``rope`` that scale it (absent: no scaling), with their defaults
ROPE_SCALING_DEFAULTS = {"freq_scale": 1.0, "ext_factor": 0.0, "attn_factor": 1.0, "yarn_orig_ctx": 0,
                         "beta_fast": 32.0, "beta_slow": 1.0}


def rope_base_freqs(head_dim: int, theta: float) -> np.ndarray:
    """freq_i = 1 / theta^(2i/head_dim), float32 as run.c computes it."""
    i2 = np.arange(0, head_dim, 2, dtype=np.float32)
    return np.float32(1.0) / np.power(np.float32(theta), i2 / np.float32(head_dim))


def yarn_corr_dims(n_dims: int, orig_ctx: int, theta: float, beta_fast: float, beta_slow: float
                   ) -> tuple[float, float]:
    """The frequency-pair indices between which YaRN ramps from extrapolation
    to interpolation (llama.cpp's ggml_rope_yarn_corr_dims, in float32)."""
    def dim(beta: float) -> float:
        return float(np.float32(n_dims) * np.log(np.float32(orig_ctx) / (np.float32(beta) * np.float32(2) * np.float32(math.pi)),
                                                  dtype=np.float32)
                     / (np.float32(2) * np.log(np.float32(theta), dtype=np.float32)))

    lo = math.floor(dim(beta_fast))
    hi = math.ceil(dim(beta_slow))
    return float(max(0, lo)), float(min(n_dims - 1, hi))


def rope_mix(head_dim: int, theta: float, attrs: dict[str, Any]) -> tuple[np.ndarray | None, np.float32]:
    """YaRN's per-pair extrapolation weight (None without YaRN) and the
    magnitude factor applied to cos and sin, both float32.

    YaRN blends, per frequency pair i, the interpolated angle (times
    ``freq_scale``) with the original one by ``ramp(i) * ext_factor``, and
    scales cos/sin by ``attn_factor * (1 + 0.1 ln(1/freq_scale))``; without
    ``ext_factor`` only ``attn_factor`` applies (llama.cpp's rope_yarn)."""
    a = {**ROPE_SCALING_DEFAULTS, **{k: v for k, v in attrs.items() if k in ROPE_SCALING_DEFAULTS}}
    ext = np.float32(a["ext_factor"])
    mscale = np.float32(a["attn_factor"])
    if ext == 0:
        return None, mscale
    lo, hi = yarn_corr_dims(head_dim, int(a["yarn_orig_ctx"]), theta, float(a["beta_fast"]),
                            float(a["beta_slow"]))
    i = np.arange(head_dim // 2, dtype=np.float32)
    y = (i - np.float32(lo)) / np.float32(max(0.001, hi - lo))
    ramp = (np.float32(1) - np.clip(y, 0, 1)).astype(np.float32)
    mix = (ramp * ext).astype(np.float32)
    fs = np.float32(a["freq_scale"])
    mscale = np.float32(mscale * (np.float32(1) + np.float32(0.1) * np.log(np.float32(1) / fs, dtype=np.float32)))
    return mix, mscale


def rope_tables(n_pos: int, pos: int, head_dim: int, theta: float, dims: int | None = None,
                freq_factors: np.ndarray | None = None, attrs: dict[str, Any] | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [n_pos, rot/2] for positions pos..pos+n_pos-1 (``rope_tables_at``)."""
    return rope_tables_at(np.arange(pos, pos + n_pos), head_dim, theta, dims, freq_factors, attrs)


def rope_tables_at(positions: np.ndarray, head_dim: int, theta: float, dims: int | None = None,
                   freq_factors: np.ndarray | None = None, attrs: dict[str, Any] | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [len(positions), rot/2] in float32 as run.c:
    freq_i = 1 / theta^(2i/head_dim), angle = position * freq_i.

    Scaling as llama.cpp applies it: the angle divided by the pair's
    frequency factor (Llama 3's ``rope_freqs``), times ``freq_scale``
    (linear: 1/factor), blended with the unscaled angle by YaRN's ramp; cos
    and sin times the magnitude factor. Each step is one float32 operation,
    in this order, so the native kernel can round exactly alike."""
    rot = dims or head_dim
    freq = rope_base_freqs(head_dim, theta)[: rot // 2]
    p = np.asarray(positions).astype(np.float32)
    ang = (p[:, None] * freq[None, :]).astype(np.float32)
    attrs = attrs or {}
    if freq_factors is not None:
        ang = (ang / np.asarray(freq_factors, np.float32)[None, : rot // 2]).astype(np.float32)
    fs = np.float32(attrs.get("freq_scale", 1.0))
    mix, mscale = rope_mix(head_dim, theta, attrs)
    if fs != 1 or mix is not None:
        interp = (fs * ang).astype(np.float32)
        if mix is not None:
            m = mix[None, : rot // 2]
            ang = (interp * (np.float32(1) - m) + ang * m).astype(np.float32)
        else:
            ang = interp
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    if mscale != 1:
        cos, sin = (cos * mscale).astype(np.float32), (sin * mscale).astype(np.float32)
    return cos, sin


@register("rope", -1, _rope)
def rope_ref(x: np.ndarray, pos: Any, freq_factors: Any = None, *, head_dim: int, theta: float, style: str,
             dims: int | None = None, **scaling: Any) -> np.ndarray:
    """Rotary position embedding. ``interleaved`` rotates (x[2i], x[2i+1]) as
    llama2.c and GGUF llama; ``neox`` rotates (x[i], x[i + head_dim/2]).
    Row t sits at position pos + t, or with ``pos`` a vector (a batch of
    sequences) at pos[t]. ``freq_factors`` (a weight, Llama 3's
    ``rope_freqs``) and the scaling attributes (``ROPE_SCALING_DEFAULTS``)
    are described in ``rope_tables_at``. ``dims`` (partial rotary, Phi-2):
    only each head's first ``dims`` values rotate, as a head of that size
    would (its own frequencies); the rest pass through."""
    x = np.asarray(x, np.float32)
    lead = x.shape[:-1]
    t = x.reshape(-1, x.shape[-1])
    n_rows = t.shape[0]
    rot = int(dims or head_dim)
    ff = None if freq_factors is None else f32_of(freq_factors)
    at = np.asarray(pos, np.int64).reshape(n_rows) if np.ndim(pos) == 1 else np.arange(int(pos), int(pos) + n_rows)
    cos, sin = rope_tables_at(at, rot, theta, freq_factors=ff, attrs=scaling)
    heads = t.reshape(n_rows, -1, head_dim)[..., :rot]
    if style == "interleaved":
        a, b = heads[..., 0::2], heads[..., 1::2]
    else:
        a, b = heads[..., : rot // 2], heads[..., rot // 2:]
    c, s = cos[:, None, :], sin[:, None, :]
    ra, rb = a * c - b * s, a * s + b * c
    out = t.reshape(n_rows, -1, head_dim).copy()
    if style == "interleaved":
        out[..., 0:rot:2], out[..., 1:rot:2] = ra, rb
    else:
        out[..., : rot // 2], out[..., rot // 2: rot] = ra, rb
    return out.reshape(lead + (x.shape[-1],))


#: bytes of one Q8_0 block of a q8 KV cache row: float16 scale, 32 int8
KV_Q8_BLOCK = quant_type("Q8_0").block_bytes


def kv_row_width(cache: np.ndarray) -> int:
    """Values per cache row. A q8 cache is its stored bytes (uint8
    [ctx, kv_dim / 32 * 34], from ``ir.interp.state_array``)."""
    if cache.dtype == np.uint8:
        return cache.shape[1] // KV_Q8_BLOCK * QK8
    return cache.shape[1]


def kv_encode_q8(rows: np.ndarray) -> np.ndarray:
    """float32 [n, D] -> Q8_0 bytes [n, D / 32 * 34], quantized as
    ``quantize_q8_rows`` (d = float16(max|x| / 127), q = rint(x * 127 / max|x|))."""
    n, k = rows.shape
    d, q = quantize_q8_rows(rows)
    blk = np.empty((n, k // QK8, KV_Q8_BLOCK), np.uint8)
    blk[..., :2] = d.astype("<f2").view(np.uint8).reshape(n, k // QK8, 2)
    blk[..., 2:] = q.view(np.uint8)
    return blk.reshape(n, -1)


def kv_read(cache: np.ndarray, start: int, end: int) -> np.ndarray:
    """Rows start..end of a cache as float32 (f16 widened, q8 dequantized: d * q)."""
    return kv_decode(cache[start:end])


def kv_decode(part: np.ndarray) -> np.ndarray:
    """Stored cache rows (any selection of them) as float32."""
    if part.dtype == np.uint8:
        blk = part.reshape(-1, KV_Q8_BLOCK)
        d = np.ascontiguousarray(blk[:, :2]).view("<f2").astype(np.float32)
        q = np.ascontiguousarray(blk[:, 2:]).view(np.int8).astype(np.float32)
        return (q * d).reshape(part.shape[0], -1)
    return part if part.dtype == np.float32 else part.astype(np.float32)


def _kv_store(cache: np.ndarray, where: Any, x: np.ndarray) -> np.ndarray:
    """cache[where] = x's rows, rounded to the cache's storage: f16
    round-to-nearest-even (overflow to inf), q8 per block of 32
    (``kv_encode_q8``)."""
    rows = np.asarray(x, np.float32).reshape(-1, kv_row_width(cache))
    with np.errstate(over="ignore"):  # f16 (or a q8 block's f16 scale) overflows to inf, as stored natively
        cache[where] = kv_encode_q8(rows) if cache.dtype == np.uint8 else rows
    return cache


@register("kv_write", 3, _kv_write, updates_state=True)
def kv_write_ref(cache: np.ndarray, x: np.ndarray, pos: Any) -> np.ndarray:
    """Store the new rows at positions pos.. (in place: the cache is state),
    rounded to the cache's storage (``_kv_store``)."""
    n = int(np.size(x)) // kv_row_width(cache)
    p = int(pos)
    if p < 0 or p + n > cache.shape[0]:
        raise IndexError(f"kv_write at {p}..{p + n} outside a cache of {cache.shape[0]}")
    return _kv_store(cache, slice(p, p + n), x)


def _attend(qrow: np.ndarray, k: np.ndarray, v: np.ndarray, group: int, scale: float,
            softcap: float = 0.0) -> np.ndarray:
    """One query row's heads [H, hd] against its visible K/V rows [n, KVH, hd].
    ``softcap`` bounds each score to (-c, c) as c * tanh(s / c) (Gemma 2)."""
    out = np.empty_like(qrow)
    for h in range(qrow.shape[0]):
        kv = h // group
        sc = (k[:, kv, :] @ qrow[h]) * np.float32(scale)
        if softcap:
            sc = softcap_ref(sc, cap=softcap)
        sc = np.exp(sc - sc.max())
        sc /= sc.sum(dtype=np.float32)
        out[h] = sc @ v[:, kv, :]
    return out


def _visible(end: int, window: int) -> int:
    """First position a query at position end-1 sees."""
    return max(0, end - window) if window else 0


@register("attention", 4, _attention)
def attention_ref(q: np.ndarray, kc: np.ndarray, vc: np.ndarray, pos: Any, *, n_heads: int,
                  n_kv_heads: int, head_dim: int, scale: float, window: int = 0, softcap: float = 0.0
                  ) -> np.ndarray:
    """Causal grouped-query attention against the cache. Row t of q sits at
    position pos+t and sees positions <= pos+t (and > pos+t-window if set)."""
    q = np.asarray(q, np.float32)
    lead = q.shape[:-1]
    qs = q.reshape(-1, n_heads, head_dim)
    p0 = int(pos)
    out = np.empty_like(qs)
    for t in range(qs.shape[0]):
        end = p0 + t + 1
        start = _visible(end, window)
        k = kv_read(kc, start, end).reshape(end - start, n_kv_heads, head_dim)
        v = kv_read(vc, start, end).reshape(end - start, n_kv_heads, head_dim)
        out[t] = _attend(qs[t], k, v, n_heads // n_kv_heads, scale, softcap)
    return out.reshape(lead + (n_heads * head_dim,))


# --- the paged KV cache (a pool of blocks shared by a batch of sequences) ---------------
def paged_rows(positions: Any, tables: Any, block_size: int, pool_rows: int) -> list[np.ndarray]:
    """Per batch row r: the pool rows of its sequence's positions 0..positions[r]
    (pool row of position p = tables[r, p // block_size] * block_size +
    p % block_size). Raises IndexError for a negative position, a position
    past the table, or a table entry it uses outside the pool."""
    pos = np.asarray(positions, np.int64).reshape(-1)
    tab = np.asarray(tables, np.int64)
    n_blocks = pool_rows // block_size
    out = []
    for r, p in enumerate(pos):
        if p < 0 or p // block_size >= tab.shape[1]:
            raise IndexError(f"row {r}: position {p} outside the block table ({tab.shape[1]} blocks of "
                             f"{block_size})")
        used = tab[r, : p // block_size + 1]
        if used.min() < 0 or used.max() >= n_blocks:
            raise IndexError(f"row {r}: block table entry outside the pool of {n_blocks} blocks")
        ps = np.arange(p + 1)
        out.append(used[ps // block_size] * block_size + ps % block_size)
    return out


@register("kv_write_paged", 4, _kv_write_paged, updates_state=True)
def kv_write_paged_ref(cache: np.ndarray, x: np.ndarray, positions: Any, tables: Any, *,
                       block_size: int) -> np.ndarray:
    """Row r of x goes to its sequence's position positions[r], at the pool
    row its block table gives (in place), rounded as ``kv_write``."""
    rows = [r[-1] for r in paged_rows(positions, tables, block_size, cache.shape[0])]
    return _kv_store(cache, np.asarray(rows, np.int64), x)


@register("rope_kv_write", -1, _rope_kv_write, updates_state=True)
def rope_kv_write_ref(cache: np.ndarray, x: np.ndarray, pos: Any, freq_factors: Any = None,
                      **rope: Any) -> np.ndarray:
    """``kv_write(cache, rope(x, pos), pos)`` as one op (``passes.fuse_elementwise``):
    the two references in turn, so the same float32 steps and the same rounding."""
    return kv_write_ref(cache, rope_ref(x, pos, freq_factors, **rope), pos)


@register("rope_kv_write_paged", -1, _rope_kv_write_paged, updates_state=True)
def rope_kv_write_paged_ref(cache: np.ndarray, x: np.ndarray, positions: Any, tables: Any,
                            freq_factors: Any = None, *, block_size: int, **rope: Any) -> np.ndarray:
    """``kv_write_paged(pool, rope(x, positions), positions, tables)`` as one op."""
    return kv_write_paged_ref(cache, rope_ref(x, positions, freq_factors, **rope), positions, tables,
                              block_size=block_size)


@register("attention_paged", 5, _attention_paged)
def attention_paged_ref(q: np.ndarray, kc: np.ndarray, vc: np.ndarray, positions: Any, tables: Any, *,
                        n_heads: int, n_kv_heads: int, head_dim: int, scale: float, window: int = 0,
                        block_size: int, softcap: float = 0.0) -> np.ndarray:
    """``attention`` for a batch of sequences in a pool: row t sits at its
    own sequence's position positions[t] and sees that sequence's positions
    max(0, positions[t] - window + 1)..positions[t] (from 0 without a
    window), read through its block table."""
    q = np.asarray(q, np.float32)
    qs = q.reshape(-1, n_heads, head_dim)
    out = np.empty_like(qs)
    for t, rows in enumerate(paged_rows(positions, tables, block_size, kc.shape[0])):
        rows = rows[_visible(len(rows), window):]
        k = kv_decode(kc[rows]).reshape(len(rows), n_kv_heads, head_dim)
        v = kv_decode(vc[rows]).reshape(len(rows), n_kv_heads, head_dim)
        out[t] = _attend(qs[t], k, v, n_heads // n_kv_heads, scale, softcap)
    return out.reshape(q.shape)


@register("add", 2, _binary, elementwise=True)
def add_ref(a: np.ndarray, b: Any) -> np.ndarray:
    return (np.asarray(a, np.float32) + f32_of(b)).astype(np.float32)


@register("bias_add", 2, _bias)
def bias_add_ref(a: np.ndarray, b: Any) -> np.ndarray:
    """a + b with b (a vector) added to every row of a."""
    return (np.asarray(a, np.float32) + f32_of(b)).astype(np.float32)


@register("mul", 2, _binary, elementwise=True)
def mul_ref(a: np.ndarray, b: Any) -> np.ndarray:
    return (np.asarray(a, np.float32) * f32_of(b)).astype(np.float32)


@register("silu", 1, _same_as_first, elementwise=True)
def silu_ref(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float32)
    return (x * (np.float32(1.0) / (np.float32(1.0) + np.exp(-x)))).astype(np.float32)


_GELU_C = np.float32(math.sqrt(2.0 / math.pi))


@register("gelu_tanh", 1, _same_as_first, elementwise=True)
def gelu_tanh_ref(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float32)
    return (np.float32(0.5) * x * (np.float32(1.0) + np.tanh(_GELU_C * (x + np.float32(0.044715) * x * x * x)))
            ).astype(np.float32)


#: the activations ``glu`` applies to its gate (its ``activation`` attribute;
#: not ``act``, which names a matmul's integer path)
GLU_ACTS = {"silu": silu_ref, "gelu_tanh": gelu_tanh_ref}


def _glu(ts: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    a = attrs.get("activation")
    _need(a in GLU_ACTS, f"glu: activation must be one of {sorted(GLU_ACTS)}, got {a!r}")
    return _binary(ts, attrs)


@register("glu", 2, _glu, elementwise=True)
def glu_ref(gate: np.ndarray, up: Any, *, activation: str) -> np.ndarray:
    """act(gate) * up: a gated FFN's two elementwise ops as one
    (``passes.fuse_elementwise``), the same float32 operations in order."""
    return mul_ref(GLU_ACTS[activation](gate), up)


@register("scale", 1, _same_as_first, elementwise=True)
def scale_ref(x: np.ndarray, *, factor: float) -> np.ndarray:
    return (np.asarray(x, np.float32) * np.float32(factor)).astype(np.float32)


@register("softcap", 1, _same_as_first, elementwise=True)
def softcap_ref(x: np.ndarray, *, cap: float) -> np.ndarray:
    """cap * tanh(x / cap): Gemma 2's soft-capping of logits, in llama.cpp's
    order (times 1/cap, tanh, times cap)."""
    c = np.float32(cap)
    return (np.tanh(np.asarray(x, np.float32) * (np.float32(1) / c)) * c).astype(np.float32)


def _layernorm(ts: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    x, w, b = ts
    _need(w.rank == 1 and b.shape == w.shape and x.shape[-1] == w.shape[0],
          f"layernorm: weight {w} and bias {b} do not fit {x}")
    return TensorType(x.shape, "f32")


@register("layernorm", 3, _layernorm)
def layernorm_ref(x: np.ndarray, w: Any, b: Any, *, eps: float) -> np.ndarray:
    """(x - mean) / sqrt(var + eps) * w + b per row (GPT-2, Phi-2, StarCoder2),
    float32 in llama.cpp's order: centre, mean of squares, scale, weight, bias."""
    xs = np.asarray(x, np.float32).reshape(-1, np.shape(x)[-1])
    c = xs - np.mean(xs, axis=1, dtype=np.float32, keepdims=True)
    inv = np.float32(1.0) / np.sqrt(np.mean(c * c, axis=1, dtype=np.float32) + np.float32(eps))
    y = (c * inv[:, None]) * f32_of(w) + f32_of(b)
    return y.astype(np.float32).reshape(np.shape(x))


def _pos_embedding(ts: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    w, pos, tokens = ts
    _need(w.rank == 2, f"pos_embedding: the table must be 2-D, got {w}")
    _need(pos.dtype == "i32" and (pos.rank == 0 or pos.shape == tokens.shape),
          f"pos_embedding: pos must be an i32 scalar or one per token of {tokens}, got {pos}")
    return TensorType(tokens.shape + (w.shape[1],), "f32")


@register("pos_embedding", 3, _pos_embedding)
def pos_embedding_ref(w: WeightData, pos: Any, tokens: Any) -> np.ndarray:
    """Learned absolute position embeddings (GPT-2): the table's row for each
    token's position, pos + t for token t of a chunk, or pos[t] in a batch."""
    shape = np.shape(tokens)
    at = np.asarray(pos, np.int64).reshape(shape) if np.ndim(pos) else int(pos) + np.arange(int(np.prod(shape)))
    return embedding_ref(w, np.asarray(at, np.int64).reshape(shape))


@register("take_last", 1, _take_last)
def take_last_ref(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32)[-1].copy()


@register("take_rows", 2, _take_rows)
def take_rows_ref(x: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The rows of x the indices name (each in [0, T): the runtime checks
    them, as every index native code uses)."""
    return np.asarray(x, np.float32)[np.asarray(rows, np.int64)].copy()


def _softmax(ts: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    (x,) = ts
    _need(x.rank >= 1 and isinstance(x.shape[-1], int), f"softmax needs a static last axis, got {x}")
    return TensorType(x.shape, "f32")


@register("softmax", 1, _softmax)
def softmax_ref(x: np.ndarray) -> np.ndarray:
    """exp(x - max) / sum over the last axis, in float32: the normalisation
    inside ``attention`` as an op of its own (``lmc kernel softmax``)."""
    x = np.asarray(x, np.float32)
    with np.errstate(invalid="ignore"):  # a row of -inf only: nan, as any softmax
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return (e / e.sum(axis=-1, keepdims=True, dtype=np.float32)).astype(np.float32)
