"""Prompt lookup decoding (``--lookup N``): the continuation of the latest
earlier occurrence of the last (up to N) tokens in the prompt and output so
far. No second model and no KV rows; strong where the output quotes its
input."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .protocol import Draft, DraftRoom


class LookupDrafter:
    """Find the longest suffix of a sequence's tokens (at most ``ngram``, at
    least 1) that occurred before, latest occurrence first, and propose
    what followed it there (as far as the room for its positions goes)."""

    name = "lookup"
    own_kv = False

    def __init__(self, ngram: int) -> None:
        self.ngram = max(1, int(ngram))

    def propose(self, seqs: Sequence[Any], ns: Sequence[int], room: DraftRoom) -> list[Draft]:
        out = []
        for s, n in zip(seqs, ns):
            d = lookup_continuation(s.tokens, self.ngram, n) if n > 0 else []
            out.append(Draft(d[: room.make_room(s, len(d))] if d else []))
        return out

    def follow_prefill(self, seq: Any, stop: int, table: list[int]) -> None:
        pass

    def copy_block(self, src: int, dst: int) -> None:
        pass

    def close(self) -> None:
        pass


def lookup_continuation(history: Sequence[int], ngram: int, n: int) -> list[int]:
    """Up to ``n`` tokens that followed the latest earlier occurrence of the
    longest suffix of ``history`` of ``ngram`` tokens or fewer; [] if none."""
    h = np.asarray(history, np.int64)
    L = len(h)
    if n < 1 or L < 2:
        return []
    for size in range(min(ngram, L - 1), 0, -1):
        suffix = h[L - size:]
        # windows h[i:i+size] for i < L - size (an occurrence ending before the suffix's start + size)
        starts = np.flatnonzero(h[: L - size] == suffix[0])
        for i in starts[::-1]:   # latest first: the nearest context repeats best
            if i + size < L and np.array_equal(h[i: i + size], suffix):
                cont = h[i + size: i + size + n]
                if len(cont):
                    return [int(t) for t in cont]
    return []
