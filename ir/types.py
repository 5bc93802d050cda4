"""Static types of IR values: shape, dtype and (for weights) a quant layout.

Shapes are tuples of ints, or of symbol names for the few dynamic quantities
(the number of tokens ``T`` in a prefill chunk). Everything else is static so
that later passes can plan memory and the code generator can emit constants.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .dims import Dim

#: dtype name -> numpy dtype; the IR speaks names, numpy only in references.
DTYPES: dict[str, np.dtype] = {
    "f32": np.dtype(np.float32),
    "f16": np.dtype(np.float16),
    "i32": np.dtype(np.int32),
    "i8": np.dtype(np.int8),
    "u8": np.dtype(np.uint8),
}


@dataclass(frozen=True)
class TensorType:
    """Type of one value. ``layout`` is set only for stored weights (their
    quant type, ``ir.quant.table``); ``repack`` is the tile width of a
    weight the runtime repacks at load (``ir/quant/repack.py``), else None:
    the same numbers in another byte order, which only the kernels see."""

    shape: tuple[Dim, ...]
    dtype: str = "f32"
    layout: str | None = None
    repack: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}")
        object.__setattr__(self, "shape", tuple(self.shape))

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def is_static(self) -> bool:
        return all(isinstance(d, int) for d in self.shape)

    def numel(self, symbols: dict[str, int] | None = None) -> int:
        n = 1
        for d in self.shape:
            n *= d if isinstance(d, int) else (symbols or {})[d]
        return n

    def nbytes(self, symbols: dict[str, int] | None = None) -> int:
        """Bytes of the value in memory (for weights: of the stored layout)."""
        if self.layout is not None:
            from .quant import layout_of

            return layout_of(self).nbytes(self.shape)
        return self.numel(symbols) * DTYPES[self.dtype].itemsize

    def with_shape(self, shape: tuple[Dim, ...]) -> "TensorType":
        return TensorType(tuple(shape), self.dtype, self.layout, self.repack)

    @property
    def stored(self) -> str | None:
        """How the bytes are laid out, as printed: the layout, and ``x16``
        after it for a weight repacked 16 rows at a time (``Q5_0x16``)."""
        return f"{self.layout}x{self.repack}" if self.repack else self.layout

    def __str__(self) -> str:
        dims = ", ".join(str(d) for d in self.shape)
        base = f"{self.dtype}[{dims}]"
        return f"{self.stored}:{base}" if self.layout else base


#: KV cache element types (``--kv-type``): name -> (dtype, layout) of the
#: cache states. q8 rows are GGUF Q8_0 blocks (32 values: f16 scale, 32 int8);
#: q4 and q2 groups of 32 with an f16 step and minimum, rotated per head by
#: a Walsh-Hadamard transform first (the layout ends in _H and head_dim),
#: the -plain ones without it (``ir.kv_lowbit``).
KV_TYPES: dict[str, tuple[str, str | None]] = {
    "f32": ("f32", None), "f16": ("f16", None), "q8": ("f32", "Q8_0"),
    "q4": ("f32", "KV_Q4_H"), "q4-plain": ("f32", "KV_Q4"), "q2": ("f32", "KV_Q2_H"), "q2-plain": ("f32", "KV_Q2")}
#: the KV cache type when none is asked for: half the bytes of f32 and, like llama.cpp's
#: default, close enough that greedy text departs from f32 only at near ties
DEFAULT_KV_TYPE = "f16"
#: KV types whose key rows are stored minus a per-layer constant (``ir.kv_lowbit``:
#: the key offset): the low-bit ones, where the keys' position-independent part
#: would otherwise take most of each group's range
KEY_OFFSET_KV_TYPES = ("q4", "q4-plain", "q2", "q2-plain")


def kv_cache_type(kv_type: str, ctx: int, kv_dim: int, head_dim: int | None = None) -> TensorType:
    """Type of one layer's K (or V) cache: ``ctx`` positions of ``kv_dim``
    values. A rotated type (q4, q2) rotates each head, so it needs ``head_dim``
    (a power of two, at least 32), which its layout then names (``KV_Q4_H64``)."""
    if kv_type not in KV_TYPES:
        raise ValueError(f"unknown KV cache type {kv_type!r} (one of {', '.join(KV_TYPES)})")
    dtype, layout = KV_TYPES[kv_type]
    if layout is not None and layout.endswith("_H"):
        if head_dim is None or head_dim < 32 or head_dim & (head_dim - 1):
            raise ValueError(f"KV cache type {kv_type} rotates each head: head_dim must be a power of two "
                             f">= 32, got {head_dim}")
        layout = f"{layout}{head_dim}"
    return TensorType((ctx, kv_dim), dtype, layout)


def f32(*shape: Dim) -> TensorType:
    return TensorType(tuple(shape), "f32")


def i32(*shape: Dim) -> TensorType:
    return TensorType(tuple(shape), "i32")
