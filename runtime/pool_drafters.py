"""Drafters for the batch engine: proposals for many sequences of the paged
KV pool at once (``lmc serve``).

The engine (``runtime.scheduler``) verifies drafts as extra rows of its
batched decode step; a drafter only proposes them. One interface
(``PoolDrafter``), two kinds:

* ``PoolLookup``: prompt lookup, per sequence, no model and no KV rows.
* ``PoolModelDrafter``: a model run through the same batch steps as the
  target, one native call per drafted token for every drafting sequence
  together. Over the target's own first K layers (``--draft-layers``) it
  reads and writes the target's pool (those layers' rows are the target's:
  the verify step rewrites the drafted positions with the same values, so
  nothing is ever rolled back). A separate draft model (``--draft``) has a
  pool of its own, as large and addressed through the same block tables,
  kept in step with the target's: it prefills every prompt chunk, copies
  every copied block, and runs every position the target runs (one row per
  generating sequence, folded into its first drafting call). So a block the
  block manager shares (a cached prefix) holds the draft's rows too.

A sequence (the engine's ``_Seq``) brings its ``tokens`` (prompt and output
so far; the last one not yet in the target's KV), ``draft_kv`` (positions
whose rows the drafter's own pool holds for these tokens) and
``draft_sampler`` (``speculative.draft_sampler``: the request's sampling
with coins of its own).
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence

import numpy as np

from .speculative import Draft, lookup_continuation, sample_draft


class DraftPool(Protocol):
    """The engine's side: blocks for drafted positions, and block tables."""

    def make_room(self, seq: Any, n: int) -> int:
        """Make the ``n`` positions after ``seq``'s tokens writable without
        preempting anyone; how many (from the first) could be."""

    def table(self, seq: Any) -> list[int]:
        """``seq``'s block table now."""


class PoolDrafter:
    """What the engine asks of a drafter. ``own_pool``: it keeps KV rows of
    its own, which the engine keeps consistent through ``prefill`` and
    ``copy_block`` and passes every generating sequence to ``propose``."""

    name = "none"
    own_pool = False

    def propose(self, seqs: Sequence[Any], ns: Sequence[int], pool: DraftPool) -> list[Draft]:
        """Up to ``ns[i]`` tokens to follow ``seqs[i].tokens`` (0: none; a
        drafter with a pool of its own still runs that sequence's new rows)."""
        raise NotImplementedError

    def prefill(self, seq: Any, stop: int, table: list[int]) -> None:
        """The target has run ``seq``'s prompt up to position ``stop``."""

    def copy_block(self, src: int, dst: int) -> None:
        """The target's pool copied block ``src`` over ``dst`` (copy on write)."""

    def close(self) -> None:
        pass


class PoolLookup(PoolDrafter):
    """Prompt lookup with n-grams of up to ``ngram`` tokens; the blocks for
    a proposal are taken after it is known (never more than it needs)."""

    name = "lookup"

    def __init__(self, ngram: int) -> None:
        self.ngram = max(1, int(ngram))

    def propose(self, seqs: Sequence[Any], ns: Sequence[int], pool: DraftPool) -> list[Draft]:
        out = []
        for s, n in zip(seqs, ns):
            d = lookup_continuation(s.tokens, self.ngram, n) if n > 0 else []
            out.append(Draft(d[: pool.make_room(s, len(d))] if d else []))
        return out


class PoolModelDrafter(PoolDrafter):
    """A draft model on a paged executor whose pool has the target's block
    size and block count. ``own_pool`` False: the executor runs on the
    target's pool (its first layers)."""

    def __init__(self, executor: Any, name: str, own_pool: bool, owner: object = None) -> None:
        self.ex = executor
        self.name = name
        self.own_pool = own_pool
        self.owner = owner   # what keeps the executor alive (a draft Model), if anything

    def propose(self, seqs: Sequence[Any], ns: Sequence[int], pool: DraftPool) -> list[Draft]:
        # blocks first: the draft writes rows at the drafted positions (all but the last)
        ns = [pool.make_room(s, n) if n > 0 else 0 for s, n in zip(seqs, ns)]
        drafts = [Draft([], None) for _ in seqs]
        # the first call: each drafting sequence's last token, after the rows the draft lacks (own pool)
        rows: list[tuple[int, int, int]] = []    # (sequence, token, position)
        for i, s in enumerate(seqs):
            L = len(s.tokens)
            lo = min(s.draft_kv, L - 1) if self.own_pool else L - 1
            if ns[i] > 0 or self.own_pool:
                rows += [(i, s.tokens[p], p) for p in range(lo, L)]
            if self.own_pool:
                s.draft_kv = L
        if not rows:
            return drafts
        tables = [pool.table(s) for s in seqs]
        logits = self._run(rows, tables)
        last = {i: r for r, (i, _, _) in enumerate(rows)}   # each sequence's last row
        live = [i for i in range(len(seqs)) if ns[i] > 0]
        cur = {i: logits[last[i]] for i in live}
        hist = {i: list(seqs[i].tokens) for i in live}
        for k in range(max(ns, default=0)):
            for i in live:
                t, q = sample_draft(seqs[i].draft_sampler, cur[i], hist[i])
                drafts[i].tokens.append(t)
                if q is not None:
                    drafts[i].q = drafts[i].q or []
                    drafts[i].q.append(q)
                hist[i].append(t)
            live = [i for i in live if ns[i] > k + 1]
            if not live:
                break
            rows = [(i, drafts[i].tokens[-1], len(seqs[i].tokens) + k) for i in live]
            out = self._run(rows, tables)
            cur = {i: out[r] for r, i in enumerate(live)}
            if self.own_pool:
                for i in live:
                    seqs[i].draft_kv = len(seqs[i].tokens) + k + 1
        return drafts

    def _run(self, rows: list[tuple[int, int, int]], tables: list[list[int]]) -> np.ndarray:
        """Logits of ``rows``, through the decode rows of the batch step (in
        pieces of the step's rows, a sequence's rows in order)."""
        width = self.ex.max_batch or len(rows)
        out = []
        for a in range(0, len(rows), width):
            part = rows[a: a + width]
            tabs = [tables[i] for i, _, _ in part]
            w = max(len(t) for t in tabs)
            out.append(self.ex.batch([t for _, t, _ in part], [p for _, _, p in part],
                                     [t + [0] * (w - len(t)) for t in tabs], decode=True))
        return out[0] if len(out) == 1 else np.concatenate(out)

    def prefill(self, seq: Any, stop: int, table: list[int]) -> None:
        if not self.own_pool or seq.draft_kv >= stop:
            return
        lo = seq.draft_kv
        self.ex.batch(seq.tokens[lo:stop], list(range(lo, stop)), [table] * (stop - lo), last_only=True)
        seq.draft_kv = stop

    def copy_block(self, src: int, dst: int) -> None:
        if self.own_pool:
            self.ex.copy_block(src, dst)

    def close(self) -> None:
        close = getattr(self.ex, "close", None)
        if close is not None:
            close()
