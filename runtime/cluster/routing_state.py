"""What the request router shares with the ingress in this process: its
decision counters and the live routers (whose replica stats ``/metrics``
reads). Apart from ``router`` because Ray Serve ships the router's module
by value (a copy): state kept there would not be the ingress's."""
from __future__ import annotations

import threading
import weakref
from typing import Any

from prometheus_client import CollectorRegistry, Counter

REGISTRY = CollectorRegistry()
ROUTING_DECISIONS = Counter("lmc_routing_decisions", "Requests routed, by why their replica was chosen: cache "
                            "(it held the longest run of the prompt's blocks), balance (loads were uneven), load "
                            "(no replica held any block: the least loaded)", ["reason"], registry=REGISTRY)
ROUTED_CACHED_BLOCKS = Counter("lmc_routed_cached_blocks", "Prompt blocks the chosen replica held when a request "
                               "was routed", registry=REGISTRY)

#: the routers alive in this process (one per deployment handle)
ROUTERS: "weakref.WeakSet[Any]" = weakref.WeakSet()

#: replica id -> requests routed to it whose stream has not ended: the router counts a request when it
#: routes it, the ingress's backend when its stream ends (Serve's own completion hook fires when a
#: stream starts, not when it ends)
_ongoing: dict[str, int] = {}
_lock = threading.Lock()


def started(replica: str) -> None:
    with _lock:
        _ongoing[replica] = _ongoing.get(replica, 0) + 1


def ended(replica: str) -> None:
    with _lock:
        if _ongoing.get(replica, 0) > 0:
            _ongoing[replica] -= 1


def forget(replica: str) -> None:
    with _lock:
        _ongoing.pop(replica, None)


def ongoing() -> dict[str, int]:
    with _lock:
        return dict(_ongoing)
