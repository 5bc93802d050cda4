"""AMX tile instructions as LLVM intrinsics (Intel's tile matrix unit:
Sapphire Rapids, Emerald Rapids, Granite Rapids).

A tile register holds up to 16 rows of 64 bytes. ``tdpbsud`` multiplies an
A tile of signed bytes (M rows x K bytes) by a B tile of unsigned bytes
stored as K/4 rows of N 4-byte groups (``vpdpbusd``'s VNNI order: 4
consecutive K values of one output column per 32-bit lane) and adds the
int32 products into C (M rows x N int32). LLVM's ``.internal`` forms take
each tile's shape as operands and write the tile configuration
(``ldtilecfg``) themselves; the tile values have LLVM's ``x86_amx`` type,
which llvmlite does not name, hence ``_AmxType``.

The process must have asked the kernel for the tile state before the
first tile instruction runs (``target.amx_status``), and emitters use them
only where ``kb.target.amx`` says so.
"""
from __future__ import annotations

from typing import NamedTuple

import llvmlite.ir as ir

from .simd import I8, I16, I64, call


class _AmxType(ir.Type):
    """LLVM's ``x86_amx``: a tile register's value."""

    def _to_string(self) -> str:
        return "x86_amx"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _AmxType)

    def __hash__(self) -> int:
        return hash("x86_amx")


TILE = _AmxType()
#: the bytes of a tile row, and its rows
ROW_BYTES, ROWS = 64, 16
_I8P = ir.PointerType(I8)


def _i16(v: int) -> ir.Constant:
    return ir.Constant(I16, v)


def tile_load(kb, rows: int, row_bytes: int, ptr: ir.Value, stride: ir.Value | int) -> ir.Value:
    """A tile of ``rows`` rows of ``row_bytes`` bytes, row r at ptr + r * stride."""
    stride = ir.Constant(I64, stride) if isinstance(stride, int) else stride
    return call(kb, "llvm.x86.tileloadd64.internal", TILE,
                [_i16(rows), _i16(row_bytes), kb.b.bitcast(ptr, _I8P), stride])


def tile_zero(kb, rows: int, row_bytes: int) -> ir.Value:
    return call(kb, "llvm.x86.tilezero.internal", TILE, [_i16(rows), _i16(row_bytes)])


def dot_signed_unsigned(kb, m: int, k: int, c: ir.Value, a: ir.Value, b: ir.Value, signed: bool = False) -> ir.Value:
    """C (m x 16 int32) + A (m x k signed bytes) . B (k/4 x 64 unsigned bytes): ``tdpbsud``
    (``signed``: B's bytes signed too, ``tdpbssd``)."""
    op = "llvm.x86.tdpbssd.internal" if signed else "llvm.x86.tdpbsud.internal"
    return call(kb, op, TILE, [_i16(m), _i16(ROW_BYTES), _i16(k), c, a, b])


def tile_store(kb, rows: int, row_bytes: int, ptr: ir.Value, stride: ir.Value | int, t: ir.Value) -> None:
    stride = ir.Constant(I64, stride) if isinstance(stride, int) else stride
    call(kb, "llvm.x86.tilestored64.internal", ir.VoidType(),
         [_i16(rows), _i16(row_bytes), kb.b.bitcast(ptr, _I8P), stride, t])


def tile_release(kb) -> None:
    """Give the tile state back (``tilerelease``): a thread that holds it
    makes every context switch save 8 KB more."""
    call(kb, "llvm.x86.tilerelease", ir.VoidType(), [])


def int8_product(kb, m: int, k: int, a: ir.Value, a_stride: ir.Value | int, b: ir.Value, c_out: ir.Value,
                 parts: int = 1) -> None:
    """C = A . B stored at ``c_out`` (m rows of 16 int32, 64 bytes apart):
    A is m rows of ``k`` signed bytes at ``a`` (``a_stride`` apart), B the
    k/4 rows of 64 unsigned bytes at ``b`` (contiguous). ``parts`` > 1:
    that many such products over consecutive K (A advancing k bytes, B
    k/4 rows) summed in the tile (exact: integers)."""
    int8_products(kb, [Product(m, k, a, a_stride, b, c_out, parts)])


class Product(NamedTuple):
    """One ``int8_product``'s operands."""

    m: int
    k: int
    a: ir.Value
    a_stride: ir.Value | int
    b: ir.Value
    c_out: ir.Value
    parts: int = 1
    #: B holds signed bytes (``tdpbssd``), not unsigned ones
    signed: bool = False


def int8_products(kb, products: list[Product]) -> None:
    """Several ``int8_product``s, two at a time interleaved: both accumulators
    live at once, so they take two tile registers and the second product
    runs while the first one's result is still in flight (tiles are not
    renamed: one register reused back to back waits for each product's
    latency, about three times its throughput)."""
    for i in range(0, len(products), 2):
        pair = products[i:i + 2]
        cs = [tile_zero(kb, p.m, ROW_BYTES) for p in pair]
        for q in range(max(p.parts for p in pair)):
            # every operand loaded before either product: four registers, so the
            # second pair of loads does not wait for the first product to read its tiles
            ops = [(n, p, tile_load(kb, p.m, p.k, kb.gep(p.a, q * p.k), p.a_stride),
                    tile_load(kb, p.k // 4, ROW_BYTES, kb.gep(p.b, q * p.k * 16), ROW_BYTES))
                   for n, p in enumerate(pair) if q < p.parts]
            for n, p, ta, tb in ops:
                cs[n] = dot_signed_unsigned(kb, p.m, p.k, cs[n], ta, tb, p.signed)
        for p, c in zip(pair, cs):
            tile_store(kb, p.m, ROW_BYTES, p.c_out, ROW_BYTES, c)
