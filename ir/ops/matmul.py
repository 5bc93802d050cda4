"""Matrix products: ``matmul`` (a float32 weight), ``qmatmul`` (a stored,
quantized one; the integer path's numbers with ``act``: ``ir.int_dot``),
its row blocks (``qmatmul_rows``) and its fused epilogue (``qmatmul_add``),
and ``dequant``."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..int_dot import ACT_LAYOUTS, qmatmul_int_ref
from ..quant import ACT_BLOCK
from ..types import TensorType
from .norm import rmsnorm_ref
from ..weight_data import WeightData, unrepacked
from .registry import f32_of, need, register, same_dim


def _matmul(ts: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    x, w = ts
    need(w.rank == 2, f"weight must be 2-D, got {w}")
    need(x.rank >= 1 and same_dim(x.shape[-1], w.shape[1]), f"matmul: {x} does not fit weight {w}")
    if "layout" in attrs:
        need(w.layout == attrs["layout"], f"qmatmul[{attrs['layout']}] on a {w.layout} weight")
    act = attrs.get("act")
    if act is not None:
        need(act in ACT_LAYOUTS, f"qmatmul: unknown activation quantization act={act!r}")
        layouts, block = ACT_LAYOUTS[act], ACT_BLOCK[act]
        need(w.layout in layouts,
              f"qmatmul act={act} needs a {'/'.join(layouts)} weight, got {w.layout}")
        need(isinstance(w.shape[1], int) and w.shape[1] % block == 0,
              f"qmatmul act={act}: row length {w.shape[1]} is not a multiple of {block}")
    return TensorType(x.shape[:-1] + (w.shape[0],), "f32")


@register("matmul", 2, _matmul)
def matmul_ref(x: np.ndarray, w: Any) -> np.ndarray:
    """x @ w.T."""
    return np.asarray(x, np.float32) @ f32_of(w).T


def _dequant(ts: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    (w,) = ts
    need(w.layout is not None, "dequant needs a stored weight")
    return TensorType(w.shape, "f32")


@register("dequant", 1, _dequant)
def dequant_ref(w: WeightData) -> np.ndarray:
    return w.to_f32()


def _without_norm(ts: list[TensorType], attrs: dict[str, Any], n: int, op: str) -> list[TensorType]:
    """The operands of a quantized matmul but a fused RMSNorm's weight
    (``norm_eps``, ``passes/fuse_norm``: then the last of n + 1, one value per
    column of x); checks it."""
    if "norm_eps" not in attrs:
        need(len(ts) == n, f"{op} takes {n} operands, got {len(ts)}")
        return ts
    need(len(ts) == n + 1, f"{op} with norm_eps takes {n} operands and the norm weight, got {len(ts)}")
    x, nw = ts[0], ts[-1]
    need(nw.rank == 1 and same_dim(nw.shape[0], x.shape[-1]),
          f"{op}: norm weight {nw} does not span the rows of {x}")
    need(isinstance(attrs["norm_eps"], float), f"{op}: norm_eps={attrs['norm_eps']!r} is not a float")
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
    need(isinstance(row0, int) and isinstance(total, int) and 0 <= row0 and row0 + w.shape[0] <= total,
          f"qmatmul_rows: rows {row0}+{w.shape[0]} do not fit a result of {total}")
    out = TensorType(part.shape[:-1] + (total,), "f32")
    if len(ts) == 3:
        need(ts[2] == out, f"qmatmul_rows: accumulator {ts[2]} is not {out}")
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
    need(r == out or (r.rank == 1 and r.dtype == "f32" and (r.layout or "F32") == "F32"
                       and same_dim(r.shape[0], out.shape[-1])),
          f"qmatmul_add: {r} is neither the product's {out} nor a bias of its rows")
    return out


@register("qmatmul_add", -1, _matmul_add)
def qmatmul_add_ref(x: np.ndarray, w: WeightData, r: Any, nw: Any = None, **attrs: Any) -> np.ndarray:
    """``add(r, qmatmul(x, w))`` or ``bias_add(qmatmul(x, w), r)`` as one op
    (``passes/fuse_residual``): the product, then the residual (or the bias,
    added to every row) as its epilogue; float32 addition commutes, so the
    bits are the two ops'. ``nw``: as qmatmul's."""
    return (qmatmul_ref(x, w, nw, **attrs) + f32_of(r)).astype(np.float32)
