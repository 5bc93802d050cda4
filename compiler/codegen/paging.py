"""Addressing a paged KV pool: which pool row holds (batch row, position).

A batch step's rows belong to different sequences; row r's sequence keeps
position p in pool row ``tables[r, p // block_size] * block_size + p %
block_size``, with ``positions`` (i32 [T]) and ``block_tables`` (i32 [T,
max_blocks]) graph inputs. The paged kernels (``kv_write_paged``,
``attention_paged``, ``rope`` with per-row positions) differ from their
single-sequence versions only in this mapping. There are no bounds checks:
the runtime validated the tables and positions (``runtime.paged``).
"""
from __future__ import annotations

import llvmlite.ir as ir

from .emit import I32, KernelBuilder, i64


class RowPositions:
    """positions[r] of an i32 [T] operand, as i64."""

    def __init__(self, kb: KernelBuilder, raw: ir.Value) -> None:
        self.kb = kb
        self.ptr = kb.b.bitcast(raw, ir.PointerType(I32))

    def __call__(self, r: ir.Value) -> ir.Value:
        kb = self.kb
        return kb.b.sext(kb.b.load(kb.gep(self.ptr, r), align=4), ir.IntType(64))


class PagedRows:
    """Pool rows of a batch row's positions through its block table."""

    def __init__(self, kb: KernelBuilder, positions_raw: ir.Value, tables_raw: ir.Value, block_size: int,
                 max_blocks: int) -> None:
        self.kb = kb
        self.position = RowPositions(kb, positions_raw)
        self.tables = kb.b.bitcast(tables_raw, ir.PointerType(I32))
        self.bs, self.max_blocks = int(block_size), int(max_blocks)

    def table(self, r: ir.Value) -> ir.Value:
        """Row r's block table (i32*)."""
        return self.kb.gep(self.tables, self.kb.b.mul(r, i64(self.max_blocks)))

    def pool_row(self, table: ir.Value, p: ir.Value) -> ir.Value:
        """The pool row (i64) of position p through ``table``."""
        b = self.kb.b
        blk = b.sext(b.load(self.kb.gep(table, b.udiv(p, i64(self.bs))), align=4), ir.IntType(64))
        return b.add(b.mul(blk, i64(self.bs)), b.urem(p, i64(self.bs)))

    def own_row(self, r: ir.Value) -> ir.Value:
        """The pool row of batch row r's own position (where its K/V go)."""
        return self.pool_row(self.table(r), self.position(r))
