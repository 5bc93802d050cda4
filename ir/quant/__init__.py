"""Quant types: the table of every weight type lmc reads (``table``), the
numpy (de)quantizers it points to (``base``, ``gguf``, ``kquants``, ``ternary``, ``qsf``)
and repacked tiles (``repack``). ``get_layout`` finds any layout by name."""
from __future__ import annotations

import functools
import re

from ..kv_lowbit import GROUP, lowbit
from .base import BlockLayout, Layout, PlanarQ8Layout
from .repack import repacked_layout, split_repacked
from .table import ACT_BLOCK, QUANT_TYPES, QuantType, quant_type, repackable, types_with

__all__ = ["ACT_BLOCK", "BlockLayout", "Layout", "PlanarQ8Layout", "QUANT_TYPES", "QuantType", "get_layout",
           "layout_of", "planar_q8", "quant_type", "repackable", "repacked_layout", "split_stored", "types_with"]

_PLANAR_Q8 = re.compile(r"^L2C_Q8G(\d+)$")


@functools.cache
def get_layout(name: str) -> Layout:
    """The layout of a type by name (``F32``, ``Q4_K``, ``L2C_Q8G64``; and a
    repacked one as printed, ``Q5_0x16``, which command lines accept)."""
    if name in QUANT_TYPES:
        return QUANT_TYPES[name].layout
    rep = split_repacked(name)
    if rep:
        return repacked_layout(*rep)
    m = _PLANAR_Q8.match(name)
    if m and int(m.group(1)) > 0:
        return PlanarQ8Layout(name, 1, "i1", int(m.group(1)))
    kv = lowbit(name)
    if kv is not None:  # a low-bit KV cache's groups (ir.kv_lowbit): only their size matters here
        return BlockLayout(name=name, itemsize=kv.group_bytes, np_dtype="u1", block=GROUP,
                           block_bytes=kv.group_bytes)
    raise KeyError(f"unknown quant layout {name!r}")


def split_stored(name: str) -> tuple[str, int | None]:
    """A layout as printed (``Q5_0x16``, ``Q4_K``) -> (layout, tile width or None)."""
    rep = split_repacked(name)
    return rep if rep else (name, None)


def layout_of(t) -> Layout:
    """The layout of a weight's type (``ir.types.TensorType``): its quant
    type's, or its repacked tiles' when ``t.repack`` is set."""
    if t.repack:
        return repacked_layout(t.layout, t.repack)
    return get_layout(t.layout or "F32")


def planar_q8(group: int) -> str:
    """Layout name of llama2.c's Q8_0 with the given group size."""
    return f"L2C_Q8G{group}"
