"""The one interface of drafters, for a single stream and a batch alike.

A drafter proposes tokens for some sequences at once (``propose``); the
caller verifies them. A single stream (``runtime.model.Model.generate``) is a
batch of one ``StreamSeq`` whose positions always have room
(``ONE_STREAM``); the batch engine passes its sequences and a ``DraftRoom``
that hands out KV blocks for drafted positions without preempting anyone.
A drafter that keeps KV rows of its own for every sequence (``own_kv``: a
draft model on a paged pool of its own) is told of the target's prefills
and block copies, and is passed every generating sequence, so its rows
follow the target's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import numpy as np


@dataclass
class Draft:
    """Proposed tokens and, for a sampled draft, the distribution each was
    drawn from (None: deterministic, q one-hot at the token)."""

    tokens: list[int] = field(default_factory=list)
    q: list[np.ndarray] | None = None


class DraftSeq(Protocol):
    """What a drafter reads of a sequence."""

    #: prompt and output so far; the last one's K/V is not in the target's cache yet
    tokens: list[int]
    #: positions whose rows a drafter's own paged KV pool holds for these tokens
    draft_kv: int
    #: the sequence's sampling, with coins of its own (``acceptance.draft_sampler``)
    draft_sampler: Any


class DraftRoom(Protocol):
    """The caller's side: room for drafted positions, and block tables."""

    def make_room(self, seq: Any, n: int) -> int:
        """Make the ``n`` positions after ``seq``'s tokens writable without
        preempting anyone; how many (from the first) could be."""

    def table(self, seq: Any) -> list[int]:
        """``seq``'s block table now (paged pools)."""


class Drafter(Protocol):
    name: str
    #: it keeps KV rows of its own for every sequence of a paged pool
    own_kv: bool

    def propose(self, seqs: Sequence[Any], ns: Sequence[int], room: DraftRoom) -> list[Draft]:
        """Up to ``ns[i]`` tokens to follow ``seqs[i].tokens`` (0: none; a
        drafter with rows of its own still runs that sequence's new rows)."""

    def follow_prefill(self, seq: Any, stop: int, table: list[int]) -> None:
        """The target has run ``seq``'s prompt up to position ``stop``."""

    def copy_block(self, src: int, dst: int) -> None:
        """The target's pool copied block ``src`` over ``dst`` (copy on write)."""

    def close(self) -> None: ...


@dataclass
class StreamSeq:
    """A single stream as a drafter sees it (``Model.generate``)."""

    tokens: list[int]
    draft_sampler: Any = None
    draft_kv: int = 0


class _OneStream:
    """A single stream's room: its KV cache is one contiguous context, every
    position is there (the generation loop keeps drafts inside it)."""

    def make_room(self, seq: Any, n: int) -> int:
        return n

    def table(self, seq: Any) -> list[int]:
        return []


ONE_STREAM: DraftRoom = _OneStream()
