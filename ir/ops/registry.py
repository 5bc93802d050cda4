"""The op registry: each op has a shape rule and one numpy reference.

The references are the semantics of the IR. ``ir.interp`` runs graphs with
them, and every pass and compiled kernel is checked against them. They work
in float32 like the C programs we compare with (llama2.c's run.c), so the
interpreter reproduces their token choices.

Conventions: activations are ``[..., features]`` (a decode step has no
leading axis, a prefill chunk has a leading ``T``); a weight matrix is stored
``[out, in]`` row-major as in the model files, so ``matmul(x, W) = x @ W.T``.
The ops themselves live in one module per family (this package's other
modules), which register here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..quant import layout_of
from ..types import Dim, TensorType


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


def need(cond: bool, msg: str) -> None:
    """A shape rule's check: ShapeError(msg) unless ``cond``."""
    if not cond:
        raise ShapeError(msg)


def same_dim(a: Dim, b: Dim) -> bool:
    return a == b
