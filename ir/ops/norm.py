"""Normalisations: RMSNorm (whole rows, or each head for per-head Q/K
norms) and LayerNorm, in float32 in the order of the programs we match."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..types import TensorType
from .registry import f32_of, need, register


def _rmsnorm(ts: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    x, w = ts
    need(w.rank == 1, f"norm weight must be 1-D, got {w}")
    n = x.shape[-1]
    need(isinstance(n, int) and n % int(w.shape[0]) == 0, f"rmsnorm: {w} does not divide {x}")
    return TensorType(x.shape, "f32")


@register("rmsnorm", 2, _rmsnorm)
def rmsnorm_ref(x: np.ndarray, w: Any, *, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * w, over chunks the size of w (whole rows,
    or each head for per-head Q/K norms). Float32 throughout, as run.c."""
    wv = f32_of(w)
    n = wv.shape[0]
    xs = np.asarray(x, np.float32).reshape(-1, n)
    ss = np.float32(1.0) / np.sqrt(np.mean(xs * xs, axis=1, dtype=np.float32) + np.float32(eps))
    return (wv * (xs * ss[:, None])).astype(np.float32).reshape(np.shape(x))


def _layernorm(ts: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    x, w, b = ts
    need(w.rank == 1 and b.shape == w.shape and x.shape[-1] == w.shape[0],
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
