"""Elementwise ops (add, mul, scale, the activations, soft-capping, the
gated FFN's ``glu``), a bias added to every row, and ``softmax``."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..types import TensorType
from .registry import f32_of, need, register


def _same_as_first(ts: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    return TensorType(ts[0].shape, "f32")


def _binary(ts: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    a, b = ts
    need(a.shape == b.shape, f"shapes differ: {a} and {b}")
    return TensorType(a.shape, "f32")


def _bias(ts: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    a, b = ts
    need(b.rank == 1 and a.shape[-1] == b.shape[0], f"bias {b} does not fit {a}")
    return TensorType(a.shape, "f32")


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
    need(a in GLU_ACTS, f"glu: activation must be one of {sorted(GLU_ACTS)}, got {a!r}")
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


def _softmax(ts: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    (x,) = ts
    need(x.rank >= 1 and isinstance(x.shape[-1], int), f"softmax needs a static last axis, got {x}")
    return TensorType(x.shape, "f32")


@register("softmax", 1, _softmax)
def softmax_ref(x: np.ndarray) -> np.ndarray:
    """exp(x - max) / sum over the last axis, in float32: the normalisation
    inside ``attention`` as an op of its own (``lmc kernel softmax``)."""
    x = np.asarray(x, np.float32)
    with np.errstate(invalid="ignore"):  # a row of -inf only: nan, as any softmax
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return (e / e.sum(axis=-1, keepdims=True, dtype=np.float32)).astype(np.float32)
