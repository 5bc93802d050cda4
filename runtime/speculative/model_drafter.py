"""Drafting with a model: a smaller one of the same vocabulary (``--draft``)
or the target's own first K layers, final norm and head (``--draft-layers``).

The drafting itself is the same for one stream and for a batch: bring the
draft's KV rows up to each sequence's tokens, then draw a token from the
draft's logits, run it, draw the next ... up to each sequence's share. Where
the draft's rows live is the ``DraftKV``'s business (``draft_kv``): a
contiguous cache of one stream, or a paged pool addressed through the
target's block tables.
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence

import numpy as np

from .acceptance import sample_draft
from .protocol import Draft, DraftRoom


class DraftKV(Protocol):
    """The draft model's executor and where its KV rows are."""

    executor: Any
    #: it keeps rows of its own for every sequence of a paged pool
    own_pool: bool

    def limit(self, seq: Any, n: int) -> int:
        """Tokens that can be drafted after ``seq``'s (the draft's context)."""

    def catch_up(self, seqs: Sequence[Any], ns: Sequence[int], tables: list[list[int]]) -> dict[int, np.ndarray]:
        """Run the rows the draft lacks; the logits after ``seqs[i].tokens``
        for every i with ``ns[i] > 0``."""

    def advance(self, rows: list[tuple[int, int, int]], seqs: Sequence[Any],
                tables: list[list[int]]) -> dict[int, np.ndarray]:
        """Run rows (sequence index, drafted token, position), at most one a
        sequence; the logits after each, by sequence index."""

    def follow_prefill(self, seq: Any, stop: int, table: list[int]) -> None: ...

    def copy_block(self, src: int, dst: int) -> None: ...


class ModelDrafter:
    """A draft model's proposals through its ``DraftKV``. ``owner``: what
    keeps the executor alive (a draft ``Model`` passed in), if anything."""

    def __init__(self, kv: DraftKV, name: str, owner: object = None) -> None:
        self.kv = kv
        self.name = name
        self.owner = owner

    @property
    def own_kv(self) -> bool:
        return self.kv.own_pool

    @property
    def executor(self) -> Any:
        return self.kv.executor

    def propose(self, seqs: Sequence[Any], ns: Sequence[int], room: DraftRoom) -> list[Draft]:
        # room first: the draft writes rows at the drafted positions (all but the last)
        ns = [room.make_room(s, self.kv.limit(s, n)) if n > 0 else 0 for s, n in zip(seqs, ns)]
        tables = [room.table(s) for s in seqs]
        drafts = [Draft([], None) for _ in seqs]
        cur = self.kv.catch_up(seqs, ns, tables)
        live = [i for i in range(len(seqs)) if ns[i] > 0]
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
            cur = self.kv.advance([(i, drafts[i].tokens[-1], len(seqs[i].tokens) + k) for i in live], seqs, tables)
        return drafts

    def follow_prefill(self, seq: Any, stop: int, table: list[int]) -> None:
        self.kv.follow_prefill(seq, stop, table)

    def copy_block(self, src: int, dst: int) -> None:
        self.kv.copy_block(src, dst)

    def close(self) -> None:
        close = getattr(self.executor, "close", None)
        if close is not None:
            close()
