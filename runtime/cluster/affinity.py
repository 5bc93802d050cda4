"""Which replica a prompt should go to: the one whose KV pool holds the
longest run of its leading blocks, unless the replicas' loads are uneven.

Each replica publishes the hashes of the full blocks its pool holds, the
block manager's own chain (``runtime.engine.block_manager.prefix_hashes``:
a block's hash covers every token up to its end), so a prompt's blocks are
hashed here the same way and looked up exactly, not guessed from
characters as Ray's ``PrefixCacheAffinityRouter`` and SGLang's router do.
What a replica publishes is a little late (it is pulled every so often), so
a prompt just routed counts as held by its replica at once, for a while
(``PENDING_S``): the next request with the same system prompt follows it
even before the first one's prefill is published.

Loads decide first when they are uneven, as SGLang's ``cache_aware`` policy
does: when the busiest replica has more than ``balance_abs`` requests more
than the idlest *and* more than ``balance_rel`` times as many, the idlest
wins whatever it holds. Otherwise the longest cached run wins; a prompt no
replica holds any block of goes to the least loaded replica, and between
equally loaded ones to the one holding the fewest blocks (its pool has the
most room for a new prefix).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Sequence

#: seconds a routed prompt's blocks count as held by its replica before the replica says so itself
PENDING_S = 30.0


@dataclass
class Decision:
    """Replicas in order of preference, and why the first one."""

    order: list[Hashable]
    #: ``cache`` (the longest cached run), ``balance`` (loads were uneven) or ``load`` (nothing cached)
    reason: str
    #: leading blocks of the prompt the first replica holds
    matched_blocks: int = 0


@dataclass
class ReplicaView:
    """What the router knows of one replica."""

    published: frozenset[bytes] = frozenset()
    #: hash -> when a prompt holding it was routed here (not yet published)
    pending: dict[bytes, float] = field(default_factory=dict)

    def holds(self, h: bytes, now: float) -> bool:
        if h in self.published:
            return True
        t = self.pending.get(h)
        return t is not None and now - t < PENDING_S

    def size(self) -> int:
        return len(self.published) + len(self.pending)


class AffinityIndex:
    def __init__(self, balance_abs: int = 4, balance_rel: float = 1.5) -> None:
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        self.views: dict[Hashable, ReplicaView] = {}

    def publish(self, replica: Hashable, hashes: Iterable[bytes]) -> None:
        """A replica's own account of its pool; pending hashes it now reports are settled."""
        v = self.views.setdefault(replica, ReplicaView())
        v.published = frozenset(hashes)
        now = time.monotonic()
        v.pending = {h: t for h, t in v.pending.items() if h not in v.published and now - t < PENDING_S}

    def routed(self, replica: Hashable, chain: Sequence[bytes]) -> None:
        """A prompt with these block hashes was sent to ``replica``."""
        v = self.views.setdefault(replica, ReplicaView())
        now = time.monotonic()
        for h in chain:
            if h not in v.published:
                v.pending[h] = now

    def forget(self, replica: Hashable) -> None:
        self.views.pop(replica, None)

    def matched(self, replica: Hashable, chain: Sequence[bytes]) -> int:
        """Leading blocks of ``chain`` the replica holds."""
        v = self.views.get(replica)
        if v is None:
            return 0
        now, n = time.monotonic(), 0
        for h in chain:
            if not v.holds(h, now):
                break
            n += 1
        return n

    def choose(self, replicas: Sequence[Hashable], loads: dict[Hashable, int], chain: Sequence[bytes]) -> Decision:
        """The replicas for a prompt whose full blocks hash to ``chain``, best first."""
        if not replicas:
            return Decision([], "load")
        by_load = sorted(replicas, key=lambda r: (loads.get(r, 0), self._size(r)))
        lo, hi = loads.get(by_load[0], 0), loads.get(by_load[-1], 0)
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            return Decision(by_load, "balance", self.matched(by_load[0], chain))
        runs = {r: self.matched(r, chain) for r in replicas}
        best = max(replicas, key=lambda r: (runs[r], -loads.get(r, 0)))
        if runs[best] == 0:
            return Decision(by_load, "load")
        return Decision([best] + [r for r in by_load if r != best], "cache", runs[best])

    def _size(self, replica: Hashable) -> int:
        v = self.views.get(replica)
        return v.size() if v is not None else 0
