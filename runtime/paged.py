"""The batch interface both executors share (continuous batching).

A batch step runs T rows, each a token of some sequence at that sequence's
own position, against a KV pool of fixed-size blocks; each row brings its
sequence's block table. Native code trusts its inputs, so every step is
checked here first, the same way for the interpreter and native code:
shapes, token ids, positions inside the context, the table entries a row
uses inside the pool, and no two rows writing the same pool row (the
kernels write rows in parallel). The block manager and scheduler that fill
the tables live elsewhere; this is the compiler's side of the contract.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class BatchError(ValueError):
    """A batch step the pool cannot run (bad shape, id, position or table)."""


class BatchIndexError(BatchError, IndexError):
    """An id, position or block number outside its range."""


@dataclass(frozen=True)
class PoolShape:
    """What a batch step is checked against."""

    block_size: int
    n_blocks: int
    max_blocks_per_seq: int
    ctx: int
    vocab: int
    max_rows: int | None   # rows one step can take (the compiled plan's T); None: any
    max_batch: int | None = None   # decode rows one step can take (sequences); None: max_rows
    #: every layer attends to at most this many positions (Mistral's window), 0 when some
    #: layer sees the whole sequence: blocks wholly before the window are never read again
    window: int = 0


def check_batch(pool: PoolShape, tokens, positions, tables) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The step's inputs as int32 arrays, tables padded with zeros to
    ``max_blocks_per_seq`` columns (entries past a row's last block are
    never read). Raises BatchError / BatchIndexError."""
    tok = np.asarray(tokens)
    pos = np.asarray(positions)
    tab = np.asarray(tables)
    for name, a in (("tokens", tok), ("positions", pos), ("block tables", tab)):
        if a.size and not np.issubdtype(a.dtype, np.integer):
            raise BatchError(f"batch {name} must be integers, got {a.dtype}")
    if tok.ndim != 1 or tok.shape[0] == 0:
        raise BatchError(f"batch tokens must be a non-empty vector, got shape {tok.shape}")
    T = tok.shape[0]
    if pos.shape != (T,):
        raise BatchError(f"batch positions must have shape ({T},), got {pos.shape}")
    if tab.ndim != 2 or tab.shape[0] != T or not 0 < tab.shape[1] <= pool.max_blocks_per_seq:
        raise BatchError(f"batch block tables must have shape ({T}, <= {pool.max_blocks_per_seq}), got {tab.shape}")
    if tok.min() < 0 or tok.max() >= pool.vocab:
        raise BatchIndexError(f"token id outside the vocabulary (0..{pool.vocab - 1})")
    if pos.min() < 0 or pos.max() >= pool.ctx:
        raise BatchIndexError(f"position outside the context (0..{pool.ctx - 1})")
    last = pos.astype(np.int64) // pool.block_size
    if last.max() >= tab.shape[1]:
        r = int(np.argmax(last >= tab.shape[1]))
        raise BatchIndexError(f"row {r}: position {int(pos[r])} needs block {int(last[r])} of its table, which "
                              f"has {tab.shape[1]}")
    used = np.arange(tab.shape[1])[None, :] <= last[:, None]
    if (tab[used] < 0).any() or (tab[used] >= pool.n_blocks).any():
        raise BatchIndexError(f"block table entry outside the pool (0..{pool.n_blocks - 1})")
    rows = tab[np.arange(T), last].astype(np.int64) * pool.block_size + pos % pool.block_size
    if np.unique(rows).size != T:
        raise BatchError("two rows of the batch write the same KV pool row (the same sequence position twice, "
                         "or a shared block not copied on write)")
    full = np.zeros((T, pool.max_blocks_per_seq), np.int32)
    full[:, : tab.shape[1]] = tab
    return tok.astype(np.int32), pos.astype(np.int32), full


class PagedBatch:
    """``batch`` and ``copy_block`` for an executor that provides
    ``_batch_step`` (one checked step of at most ``max_rows`` rows, or
    ``max_batch`` decode rows) and
    ``_copy_block_rows`` (the copy itself), and sets ``pool``."""

    pool: PoolShape

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def n_blocks(self) -> int:
        return self.pool.n_blocks

    @property
    def max_blocks_per_seq(self) -> int:
        return self.pool.max_blocks_per_seq

    @property
    def max_rows(self) -> int | None:
        return self.pool.max_rows

    @property
    def max_batch(self) -> int | None:
        return self.pool.max_batch if self.pool.max_batch is not None else self.pool.max_rows

    @property
    def can_select(self) -> bool:
        """Whether ``batch(..., select=...)`` runs in one step (a ``batch_sel`` entry)."""
        return "batch_sel" in self._entry_names()

    def batch(self, tokens, positions, tables, last_only: bool = False, decode: bool = False,
              select=None) -> np.ndarray:
        """Run one step: row r is token ``tokens[r]`` of the sequence whose
        block table is ``tables[r]``, at position ``positions[r]``; its K/V
        rows go into the pool and it attends over its sequence's positions
        up to its own (rows of one sequence in one step see each other).
        Returns float32 logits [T, vocab], or with ``last_only`` the last
        row's [vocab] (a prompt chunk of one sequence, in position order:
        longer than ``max_rows`` it runs in pieces). A fresh array, not a
        view of executor memory.

        ``decode``: every row is a distinct sequence's next token (at most
        ``max_batch`` rows). They run through ``batch_decode`` where the
        model has it (built where ``int_dot`` runs: each row's matmuls are
        the decode step's, integer path included, so its logits are, bit
        for bit, what that sequence's own decode step gives), else as
        ``batch``.

        ``select`` (row indices, at most ``max_batch``; ``can_select``):
        only those rows' logits, [len(select), vocab], in one step of at most
        ``max_rows`` rows: decode rows and prompt chunks of several sequences
        together, each row with the numbers ``batch`` gives it."""
        tok, pos, tab = check_batch(self.pool, tokens, positions, tables)
        if select is not None:
            if last_only or decode:
                raise BatchError("select names the rows whose logits come back: not with last_only or decode")
            sel = np.asarray(select)
            if sel.ndim != 1 or sel.size == 0 or not np.issubdtype(sel.dtype, np.integer):
                raise BatchError(f"select must be a non-empty vector of row indices, got {select!r}")
            if not self.can_select:
                raise BatchError("this model has no step that selects rows (its decode rows need batch_decode)")
            if sel.size > self.max_batch:
                raise BatchError(f"select names {sel.size} rows, more than this model's {self.max_batch}")
            if sel.min() < 0 or sel.max() >= len(tok):
                raise BatchIndexError(f"select: a row index outside the step's {len(tok)} rows")
            if self.pool.max_rows is not None and len(tok) > self.pool.max_rows:
                raise BatchError(f"a batch of {len(tok)} rows is more than this model's {self.pool.max_rows} rows "
                                 f"per step (split it)")
            rows = np.zeros(self.max_batch, np.int32)
            rows[: sel.size] = sel
            return np.array(self._batch_step(tok, pos, tab, False, rows=rows)[: sel.size], np.float32)
        if decode:
            if last_only:
                raise BatchError("decode rows give every row's logits: decode and last_only do not go together")
            if self.max_batch is not None and len(tok) > self.max_batch:
                raise BatchError(f"{len(tok)} decode rows are more than this model's {self.max_batch} sequences "
                                 f"per step (split them)")
            return np.array(self._batch_step(tok, pos, tab, False, decode=True), np.float32)
        n = self.pool.max_rows
        if n is None or len(tok) <= n:
            return np.array(self._batch_step(tok, pos, tab, last_only), np.float32)
        if not last_only:
            raise BatchError(f"a batch of {len(tok)} rows is more than this model's {n} rows per step (split it, or "
                             f"use last_only for one sequence's prompt)")
        out = None
        for s in range(0, len(tok), n):
            out = self._batch_step(tok[s: s + n], pos[s: s + n], tab[s: s + n], True)
        return np.array(out, np.float32)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block ``src``'s rows over block ``dst`` in every layer's K
        and V pool (copy-on-write of a shared prefix block)."""
        for what, b in (("src", src), ("dst", dst)):
            if not (isinstance(b, (int, np.integer)) and 0 <= b < self.pool.n_blocks):
                raise BatchIndexError(f"copy_block {what}={b!r}: not a block of the pool (0..{self.pool.n_blocks - 1})")
        if src != dst:
            self._copy_block_rows(int(src), int(dst))

    def _batch_step(self, tokens: np.ndarray, positions: np.ndarray, tables: np.ndarray,
                    last_only: bool, decode: bool = False) -> np.ndarray:
        raise NotImplementedError

    def _copy_block_rows(self, src: int, dst: int) -> None:
        raise NotImplementedError


def single_stream_only(what: str) -> BatchError:
    """The error for decode/prefill on a model built for batched serving."""
    return BatchError(f"{what}: this model was built for batched serving (a paged KV pool); run it with batch()")
