"""Ops that pick rows: a table's rows by token id (``embedding``) or by
position (``pos_embedding``), a chunk's last row or named rows."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..types import TensorType
from ..weight_data import WeightData
from .registry import need, register


def _embedding(ts: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    w, ids = ts
    need(w.rank == 2, f"embedding table must be 2-D, got {w}")
    need(ids.dtype == "i32", f"token ids must be i32, got {ids}")
    return TensorType(ids.shape + (w.shape[1],), "f32")


@register("embedding", 2, _embedding)
def embedding_ref(w: WeightData, ids: np.ndarray) -> np.ndarray:
    ids = np.asarray(ids, dtype=np.int64)
    vocab = int(w.type.shape[0])
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise IndexError(f"token id out of range [0, {vocab})")
    return w.rows(ids.reshape(-1)).reshape(ids.shape + (int(w.type.shape[1]),))


def _pos_embedding(ts: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    w, pos, tokens = ts
    need(w.rank == 2, f"pos_embedding: the table must be 2-D, got {w}")
    need(pos.dtype == "i32" and (pos.rank == 0 or pos.shape == tokens.shape),
          f"pos_embedding: pos must be an i32 scalar or one per token of {tokens}, got {pos}")
    return TensorType(tokens.shape + (w.shape[1],), "f32")


@register("pos_embedding", 3, _pos_embedding)
def pos_embedding_ref(w: WeightData, pos: Any, tokens: Any) -> np.ndarray:
    """Learned absolute position embeddings (GPT-2): the table's row for each
    token's position, pos + t for token t of a chunk, or pos[t] in a batch."""
    shape = np.shape(tokens)
    at = np.asarray(pos, np.int64).reshape(shape) if np.ndim(pos) else int(pos) + np.arange(int(np.prod(shape)))
    return embedding_ref(w, np.asarray(at, np.int64).reshape(shape))


def _take_last(ts: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    (x,) = ts
    need(x.rank == 2, f"take_last needs [T, n], got {x}")
    return TensorType(x.shape[1:], "f32")


@register("take_last", 1, _take_last)
def take_last_ref(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32)[-1].copy()


def _take_rows(ts: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    x, rows = ts
    need(x.rank == 2, f"take_rows needs [T, n], got {x}")
    need(rows.rank == 1 and rows.dtype == "i32" and isinstance(rows.shape[0], int),
          f"take_rows needs a fixed number of i32 row indices, got {rows}")
    return TensorType((rows.shape[0], x.shape[1]), "f32")


@register("take_rows", 2, _take_rows)
def take_rows_ref(x: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The rows of x the indices name (each in [0, T): the runtime checks
    them, as every index native code uses)."""
    return np.asarray(x, np.float32)[np.asarray(rows, np.int64)].copy()
