"""Where a draft model's KV rows live (``model_drafter.DraftKV``).

* ``StreamKV``: one stream's contiguous cache (``Model.generate``). A draft
  model of its own keeps the ids its rows hold and runs only what changed
  (a chat's next turn, the rows past a rejected draft); the target's first
  layers (``shared``) run on the target's cache, where every row but the
  pending token's is the target's own.
* ``PagedKV``: the batch engine's pool, one native call per drafted token
  for every drafting sequence together. Over the target's first K layers it
  reads and writes the target's pool (those layers' rows are the target's:
  the verify step rewrites the drafted positions with the same values, so
  nothing is ever rolled back). A separate draft model has a pool of its
  own (``own_pool``), as large and addressed through the same block
  tables, kept in step with the target's: it prefills every prompt chunk,
  copies every copied block, and runs every position the target runs (one
  row per generating sequence, folded into its first drafting call). So a
  block the block manager shares (a cached prefix) holds the draft's rows
  too. A sequence's ``draft_kv`` counts the positions it holds.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..prefix import common_prefix


class StreamKV:
    """A single stream's draft executor (``decode``/``prefill``)."""

    own_pool = False

    def __init__(self, executor: Any, shared: bool) -> None:
        self.executor = executor
        self.shared = shared
        self._kv: list[int] = []   # the ids whose K/V rows the draft's own cache holds

    def limit(self, seq: Any, n: int) -> int:
        L, ctx = len(seq.tokens), self.executor.ctx
        return 0 if L >= ctx else min(n, ctx - L + 1)   # the last drafted token needs no row

    def catch_up(self, seqs: Sequence[Any], ns: Sequence[int], tables: list[list[int]]) -> dict[int, np.ndarray]:
        out = {}
        ex = self.executor
        for i, s in enumerate(seqs):
            if ns[i] <= 0:
                continue
            hist = list(s.tokens)
            L = len(hist)
            # the target's cache holds every row but the pending token's
            start = L - 1 if self.shared else ex.reusable(min(common_prefix(hist, self._kv), L - 1))
            if L - start == 1:
                out[i] = ex.decode(hist[-1], start)
            else:
                if start == 0 and not self.shared:
                    ex.reset()
                out[i] = ex.prefill(hist[start:], start)
            self._kv = hist
        return out

    def advance(self, rows: list[tuple[int, int, int]], seqs: Sequence[Any],
                tables: list[list[int]]) -> dict[int, np.ndarray]:
        out = {}
        for i, tok, pos in rows:
            out[i] = self.executor.decode(tok, pos)
            self._kv.append(tok)
        return out

    def follow_prefill(self, seq: Any, stop: int, table: list[int]) -> None:
        pass

    def copy_block(self, src: int, dst: int) -> None:
        pass


class PagedKV:
    """A draft executor built for batched serving: its batch steps' decode
    rows, on the target's pool or (``own_pool``) on one of its own."""

    def __init__(self, executor: Any, own_pool: bool) -> None:
        self.executor = executor
        self.own_pool = own_pool

    def limit(self, seq: Any, n: int) -> int:
        return n

    def catch_up(self, seqs: Sequence[Any], ns: Sequence[int], tables: list[list[int]]) -> dict[int, np.ndarray]:
        # each drafting sequence's last token, after the rows the draft lacks (own pool)
        rows: list[tuple[int, int, int]] = []    # (sequence, token, position)
        for i, s in enumerate(seqs):
            L = len(s.tokens)
            lo = min(s.draft_kv, L - 1) if self.own_pool else L - 1
            if ns[i] > 0 or self.own_pool:
                rows += [(i, s.tokens[p], p) for p in range(lo, L)]
            if self.own_pool:
                s.draft_kv = L
        if not rows:
            return {}
        logits = self._run(rows, tables)
        last = {i: r for r, (i, _, _) in enumerate(rows)}   # each sequence's last row
        return {i: logits[last[i]] for i in range(len(seqs)) if ns[i] > 0}

    def advance(self, rows: list[tuple[int, int, int]], seqs: Sequence[Any],
                tables: list[list[int]]) -> dict[int, np.ndarray]:
        out = self._run(rows, tables)
        if self.own_pool:
            for i, _, p in rows:
                seqs[i].draft_kv = p + 1
        return {i: out[r] for r, (i, _, _) in enumerate(rows)}

    def _run(self, rows: list[tuple[int, int, int]], tables: list[list[int]]) -> np.ndarray:
        """Logits of ``rows``, through the decode rows of the batch step (in
        pieces of the step's rows, a sequence's rows in order)."""
        width = self.executor.max_batch or len(rows)
        out = []
        for a in range(0, len(rows), width):
            part = rows[a: a + width]
            tabs = [tables[i] for i, _, _ in part]
            w = max(len(t) for t in tabs)
            out.append(self.executor.batch([t for _, t, _ in part], [p for _, _, p in part],
                                           [t + [0] * (w - len(t)) for t in tabs], decode=True))
        return out[0] if len(out) == 1 else np.concatenate(out)

    def follow_prefill(self, seq: Any, stop: int, table: list[int]) -> None:
        if not self.own_pool or seq.draft_kv >= stop:
            return
        lo = seq.draft_kv
        self.executor.batch(seq.tokens[lo:stop], list(range(lo, stop)), [table] * (stop - lo), last_only=True)
        seq.draft_kv = stop

    def copy_block(self, src: int, dst: int) -> None:
        if self.own_pool:
            self.executor.copy_block(src, dst)
