"""Layouts: how a weight's numbers are stored, as numpy (de)quantizers.

A layout knows the byte size of a tensor of a given shape and how to turn its
raw bytes (a whole tensor, or one row of it) into float32. These dequantizers
are the numpy references that fused kernels are tested against; no kernel
ever writes a dequantized matrix out. A block layout reads the facts of its
type (block size, bytes, where each field sits) from its row of the quant
type table (``ir.quant.table``), never from constants of its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..dims import Dim


def _rows_cols(shape: tuple[Dim, ...]) -> tuple[int, int]:
    cols = int(shape[-1])
    rows = 1
    for d in shape[:-1]:
        rows *= int(d)
    return rows, cols


@dataclass(frozen=True)
class Layout:
    """Base: plain little-endian element storage (F32, F16)."""

    name: str
    itemsize: int
    np_dtype: str

    def nbytes(self, shape: tuple[Dim, ...]) -> int:
        rows, cols = _rows_cols(shape)
        return rows * cols * self.itemsize

    def dequantize(self, raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """Raw bytes of the whole tensor -> float32 array of ``shape``."""
        return np.frombuffer(raw, dtype=self.np_dtype).astype(np.float32).reshape(shape)

    def dequantize_rows(self, raw: np.ndarray, shape: tuple[int, ...], rows: np.ndarray) -> np.ndarray:
        """Only the given rows of a 2-D tensor (an embedding lookup reads one row)."""
        _, cols = _rows_cols(shape)
        mat = np.frombuffer(raw, dtype=self.np_dtype, count=shape[0] * cols).reshape(shape[0], cols)
        return mat[rows].astype(np.float32)


@dataclass(frozen=True)
class PlanarQ8Layout(Layout):
    """llama2.c version-2 checkpoints (runq.c): all int8 values of a tensor,
    then one float32 scale per ``group`` values. Planar, not interleaved."""

    group: int = 64

    def nbytes(self, shape: tuple[Dim, ...]) -> int:
        rows, cols = _rows_cols(shape)
        n = rows * cols
        if n % self.group:
            raise ValueError(f"{self.name}: {n} values are not a multiple of the group size {self.group}")
        return n + n // self.group * 4

    def _split(self, raw: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        buf = np.frombuffer(raw, dtype=np.uint8, count=self.nbytes((n,)))
        q = buf[:n].view(np.int8)
        s = buf[n:].view("<f4")
        return q, s

    def dequantize(self, raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        rows, cols = _rows_cols(shape)
        q, s = self._split(raw, rows * cols)
        g = self.group
        return (q.reshape(-1, g).astype(np.float32) * s[:, None]).reshape(shape)

    def dequantize_rows(self, raw: np.ndarray, shape: tuple[int, ...], rows: np.ndarray) -> np.ndarray:
        nrows, cols = _rows_cols(shape)
        q, s = self._split(raw, nrows * cols)
        rows = np.asarray(rows, dtype=np.int64)
        # flat element index of each value; a group may straddle two rows
        flat = rows[..., None] * cols + np.arange(cols)
        return q[flat].astype(np.float32) * s[flat // self.group]


@dataclass(frozen=True)
class BlockLayout(Layout):
    """Rows of fixed-size blocks (GGUF's quant types, QSF's): ``block``
    values in ``block_bytes`` bytes, scales inside each block; a block never
    crosses a row. Made from a quant type's row (``qt``), whose ``fields``
    say where each part of a block sits (``at``). Subclasses give
    ``dequant_blocks``: uint8 [nblocks, block_bytes] -> float32 [nblocks, block]."""

    block: int = 32
    block_bytes: int = 34
    qt: Any = None   # its row of ir.quant.table (a QuantType: the table imports the layouts)

    @classmethod
    def of(cls, qt: Any, **extra: Any) -> "BlockLayout":
        return cls(name=qt.name, itemsize=qt.block_bytes, np_dtype="u1", block=qt.block,
                   block_bytes=qt.block_bytes, qt=qt, **extra)

    def at(self, field: str) -> int:
        """Byte offset of ``field`` in a block (the type's row says)."""
        return self.qt.at(field)

    def nbytes(self, shape: tuple[Dim, ...]) -> int:
        rows, cols = _rows_cols(shape)
        if cols % self.block:
            raise ValueError(f"{self.name}: row length {cols} is not a multiple of the block size {self.block}")
        return rows * (cols // self.block) * self.block_bytes

    def dequant_blocks(self, blocks: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def dequantize(self, raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        n = self.nbytes(shape)
        blocks = np.frombuffer(raw, dtype=np.uint8, count=n).reshape(-1, self.block_bytes)
        return self.dequant_blocks(blocks).reshape(shape)

    def dequantize_rows(self, raw: np.ndarray, shape: tuple[int, ...], rows: np.ndarray) -> np.ndarray:
        nrows, cols = _rows_cols(shape)
        rb = cols // self.block * self.block_bytes
        mat = np.frombuffer(raw, dtype=np.uint8, count=nrows * rb).reshape(nrows, rb)
        rows = np.asarray(rows, dtype=np.int64)
        picked = mat[rows.reshape(-1)].reshape(-1, self.block_bytes)
        return self.dequant_blocks(picked).reshape(rows.shape + (cols,))


class BlockQuantizer:
    """``quantize`` for the block layouts that have a ``quantize_blocks`` of
    their own (float32 [n, block] -> uint8 [n, block_bytes]): the whole
    tensor, ``chunk`` blocks at a time (bounded temporaries)."""

    chunk = 1024

    def quantize(self, matrix: np.ndarray) -> np.ndarray:
        """float32 [rows, cols] -> the stored bytes of the whole tensor (uint8,
        rows * cols / block * block_bytes long), blocks in row-major order."""
        m = np.asarray(matrix, np.float32)
        cols = m.shape[-1] if m.ndim else 1
        if m.ndim == 0 or cols % self.block:
            raise ValueError(f"{self.name}: {cols} columns are not a multiple of the block size {self.block}")
        blocks = np.ascontiguousarray(m).reshape(-1, self.block)
        out = np.empty((blocks.shape[0], self.block_bytes), np.uint8)
        for s in range(0, blocks.shape[0], self.chunk):
            out[s:s + self.chunk] = self.quantize_blocks(blocks[s:s + self.chunk])
        return out.reshape(-1)
