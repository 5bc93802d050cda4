"""A weight as the interpreter and the references see it: its stored bytes
and its type, dequantized on demand by its layout (``ir.quant``)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .quant import layout_of
from .types import TensorType


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
