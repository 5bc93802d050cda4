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

from ..types import Dim, TensorType
from ..weight_data import WeightData


class ShapeError(ValueError):
    """An op was applied to values whose types do not fit its rule."""


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
