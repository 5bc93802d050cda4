"""The quant type table: every weight type lmc reads, one row each.

A row states its type's facts once: values and bytes per block, where each
field of a block sits, how its integer path sees it (the activation format
and the zero point that makes its quants unsigned), its repacked tile, and
GGUF's id for it. The numpy (de)quantizer (``layout``), the ``int_dot`` pass,
repacking, the kernels, the kernel lab and ``lmc inspect`` all read these
rows; no block fact is written anywhere else. A new type is a row here plus
its numpy layout class (and, for speed, its kernels).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from .base import Layout
from .gguf import BF16Layout, NibbleLayout, Q8_0Layout
from .kquants import Q2KLayout, Q3KLayout, Q4KLayout, Q5KLayout, Q6KLayout
from .lut import IQ4NLLayout, IQ4XSLayout, MXFP4Layout
from .qsf import Q2Layout, Q2SLayout, Q4Layout, Q8Layout, TernaryLayout
from .ternary import TQ1Layout, TQ2Layout

#: activation formats of the integer path: values per activation block
ACT_BLOCK = {"q8": 32, "q8k": 256}


@dataclass(frozen=True)
class QuantType:
    """One weight type's facts (module docstring)."""

    name: str
    block: int                 # values per block (1: a plain element type)
    block_bytes: int           # bytes per block
    family: str                # "float", "gguf", "kquant", "ternary", "lut", "qsf": where its layout and kernels live
    #: byte offset of each field of a block: d (scale), m (offset), dmin, z (zero point),
    #: qs (quants), qh (high bits), scales, hmask, sign, zero ...
    fields: tuple[tuple[str, int], ...] = ()
    #: the integer path's unsigned quants are the signed ones plus this (vpdpbusd
    #: multiplies unsigned weight bytes); the numpy layouts subtract it from stored quants
    zero: int = 0
    offset: bool = False       # value = d q + m: a block offset the integer path adds as m d_x sum(q_x)
    sub_block: int | None = None    # values per sub-block with a scale of its own (the K-quants)
    act: str | None = None     # activation format of the integer path ("q8", "q8k"), None: none
    tile_bytes: int | None = None   # bytes per row of a repacked tile block; None: no repacked form
    ggml_type: int | None = None    # GGUF's type id
    dequantizer: Any = None    # the numpy layout class (``ir.quant.base.Layout``)

    def at(self, field: str) -> int:
        for name, off in self.fields:
            if name == field:
                return off
        raise KeyError(f"{self.name} has no field {field!r}")

    def has(self, field: str) -> bool:
        return any(name == field for name, _ in self.fields)

    @property
    def layout(self) -> Layout:
        return _layout_of(self)


@functools.cache
def _layout_of(qt: QuantType) -> Layout:
    if qt.family == "float" and qt.dequantizer is None:
        return Layout(qt.name, qt.block_bytes, {"F32": "<f4", "F16": "<f2"}[qt.name])
    return qt.dequantizer.of(qt)


def _f(**fields: int) -> tuple[tuple[str, int], ...]:
    return tuple(fields.items())


_ROWS = [
    QuantType("F32", 1, 4, "float", ggml_type=0),
    QuantType("F16", 1, 2, "float", ggml_type=1),
    QuantType("BF16", 1, 2, "float", ggml_type=30, dequantizer=BF16Layout),
    # GGUF's 32-value blocks
    QuantType("Q8_0", 32, 34, "gguf", _f(d=0, qs=2), zero=128, act="q8", tile_bytes=34, ggml_type=8,
              dequantizer=Q8_0Layout),
    QuantType("Q4_0", 32, 18, "gguf", _f(d=0, qs=2), zero=8, act="q8", tile_bytes=18, ggml_type=2,
              dequantizer=NibbleLayout),
    QuantType("Q4_1", 32, 20, "gguf", _f(d=0, m=2, qs=4), offset=True, act="q8", tile_bytes=20, ggml_type=3,
              dequantizer=NibbleLayout),
    QuantType("Q5_0", 32, 22, "gguf", _f(d=0, qh=2, qs=6), zero=16, act="q8", tile_bytes=22, ggml_type=6,
              dequantizer=NibbleLayout),
    QuantType("Q5_1", 32, 24, "gguf", _f(d=0, m=2, qh=4, qs=8), offset=True, act="q8", tile_bytes=24,
              ggml_type=7, dequantizer=NibbleLayout),
    # GGUF's K-quants: super-blocks of 256 values
    QuantType("Q2_K", 256, 84, "kquant", _f(scales=0, qs=16, d=80, dmin=82), sub_block=16, act="q8k", ggml_type=10,
              dequantizer=Q2KLayout),
    QuantType("Q3_K", 256, 110, "kquant", _f(hmask=0, qs=32, scales=96, d=108), zero=4, sub_block=16, act="q8k",
              ggml_type=11,
              dequantizer=Q3KLayout),
    QuantType("Q4_K", 256, 144, "kquant", _f(d=0, dmin=2, scales=4, qs=16), sub_block=32, act="q8k", tile_bytes=148,
              ggml_type=12, dequantizer=Q4KLayout),
    QuantType("Q5_K", 256, 176, "kquant", _f(d=0, dmin=2, scales=4, qh=16, qs=48), sub_block=32, act="q8k",
              tile_bytes=180,
              ggml_type=13, dequantizer=Q5KLayout),
    QuantType("Q6_K", 256, 210, "kquant", _f(ql=0, qh=128, scales=192, d=208), zero=32, sub_block=16, act="q8k",
              tile_bytes=212, ggml_type=14, dequantizer=Q6KLayout),
    # GGUF's ternary types (BitNet b1.58): super-blocks of 256 values, one scale; value = (code - 1) d,
    # to the integer path a K-quant with one sub-block of scale 1 (ir/quant/ternary.py)
    QuantType("TQ1_0", 256, 54, "ternary", _f(qs=0, qh=48, d=52), zero=1, sub_block=256, act="q8k", ggml_type=34,
              dequantizer=TQ1Layout),
    QuantType("TQ2_0", 256, 66, "ternary", _f(qs=0, d=64), zero=1, sub_block=256, act="q8k", ggml_type=35,
              dequantizer=TQ2Layout),
    # GGUF's table types: 4-bit indices into 16 int8 values (ir/quant/lut.py); the integer
    # path's quants are the table's values, unsigned as value + zero
    QuantType("IQ4_NL", 32, 18, "lut", _f(d=0, qs=2), zero=128, act="q8", ggml_type=20, dequantizer=IQ4NLLayout),
    QuantType("IQ4_XS", 256, 136, "lut", _f(d=0, scales_h=2, scales_l=4, qs=8), zero=128, sub_block=32, act="q8",
              ggml_type=23, dequantizer=IQ4XSLayout),
    QuantType("MXFP4", 32, 17, "lut", _f(e=0, qs=1), zero=128, act="q8", ggml_type=39, dequantizer=MXFP4Layout),
    # QSF's 64-value blocks (docs/qsf.md)
    QuantType("QSF_Q8", 64, 66, "qsf", _f(d=0, qs=2), zero=128, act="q8", dequantizer=Q8Layout),
    QuantType("QSF_Q4", 64, 36, "qsf", _f(d=0, z=2, qs=4), offset=True, act="q8", dequantizer=Q4Layout),
    QuantType("QSF_Q2", 64, 20, "qsf", _f(d=0, m=2, qs=4), offset=True, act="q8", dequantizer=Q2Layout),
    QuantType("QSF_Q2S", 64, 18, "qsf", _f(d=0, qs=2), offset=True, act="q8", dequantizer=Q2SLayout),
    QuantType("QSF_TERNARY", 64, 18, "qsf", _f(d=0, sign=2, zero=10), zero=1, act="q8", dequantizer=TernaryLayout),
]

#: name -> row
QUANT_TYPES: dict[str, QuantType] = {r.name: r for r in _ROWS}


def quant_type(name: str) -> QuantType:
    """The row of a type (``Q4_K``, ``QSF_Q2`` ...); KeyError for any other name."""
    try:
        return QUANT_TYPES[name]
    except KeyError:
        raise KeyError(f"unknown quant type {name!r}") from None


def types_with(**facts: Any) -> tuple[str, ...]:
    """Names of the types whose rows have all of ``facts`` (``act="q8"``, ``family="qsf"`` ...)."""
    return tuple(r.name for r in _ROWS if all(getattr(r, k) == v for k, v in facts.items()))


def repackable() -> tuple[str, ...]:
    """The types with a repacked form."""
    return tuple(r.name for r in _ROWS if r.tile_bytes is not None)
