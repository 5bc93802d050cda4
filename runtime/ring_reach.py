"""How far back one stream's cache can be rewound when some layers keep a
ring (a sliding-window layer's cache of window + chunk positions,
``ir.ops.attention``).

Rewinding a cache is how lmc reuses work: a chat turn keeps the rows of the
prefix it shares with the last one, and speculative decoding drops the rows
of rejected drafts. In a ring, writing position q overwrote position q - R;
rows of positions before a rewind point s are intact for the next step only
when the furthest position written since the last reset is at most
``slack`` (= R - window, the most rows a step writes) past s. Farther back,
the window before s is gone and the prompt must run again from 0.
"""
from __future__ import annotations


class RingReach:
    """Mixed into the single-stream executors: they note how far they wrote
    (``wrote``), callers ask ``reusable`` before reusing a prefix."""

    #: R - window of the rings (the same for every ring layer), None: no rings
    ring_slack: int | None = None
    _written_end = 0

    def wrote(self, end: int) -> None:
        """Positions up to ``end`` (exclusive) were just written."""
        if end > self._written_end:
            self._written_end = end

    def forget_writes(self) -> None:
        """The cache starts over (reset)."""
        self._written_end = 0

    def reusable(self, start: int) -> int:
        """``start`` if the cache's rows before it can be reused, else 0."""
        if self.ring_slack is None or self._written_end - start <= self.ring_slack:
            return start
        return 0
