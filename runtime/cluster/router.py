"""The Ray Serve request router of ``lmc serve --replicas``: routes each
request by the KV blocks the replicas really hold (``affinity``).

Ray Serve runs it inside the process that holds the deployment handle (the
ingress), and calls ``choose_replicas`` per request; the replicas' published
block hashes arrive as their routing stats (``record_routing_stats`` of
``replica.EngineReplica``). The router counts its decisions
and registers itself where the ingress's ``/metrics`` finds the replicas'
latest stats (``routing_state``).
"""
from __future__ import annotations

import random
from typing import Any, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from ..engine.block_manager import prefix_hashes
from . import routing_state as state
from .affinity import AffinityIndex, Decision


class CacheAffinityRouter(RequestRouter):
    def initialize_state(self, block_size: int = 16, balance_abs: int = 4, balance_rel: float = 1.5,
                         policy: str = "cache", **_: Any) -> None:
        """``request_router_kwargs``: the engines' block size, the
        thresholds beyond which loads count as uneven (``affinity``), and
        the policy: ``cache`` (``affinity``), or ``power-of-two`` (two
        replicas drawn at random, the less loaded first: Ray Serve's
        default, blind to the caches; the baseline ``cache`` is measured
        against)."""
        self.block_size = block_size
        self.policy = policy
        self.index = AffinityIndex(balance_abs, balance_rel)
        self._chains: dict[str, list[bytes]] = {}
        state.ROUTERS.add(self)

    def replica_stats(self) -> dict[str, dict[str, Any]]:
        """Each running replica's latest routing stats, by its id."""
        return {rid.unique_id: dict(r.routing_stats or {}) for rid, r in self.curr_replicas.items()}

    def _chain(self, pending: Optional[PendingRequest]) -> list[bytes]:
        if pending is None or not pending.args:
            return []
        key = pending.metadata.internal_request_id
        chain = self._chains.get(key)
        if chain is None:
            ids = getattr(pending.args[0], "prompt_ids", None) or []
            chain = self._chains[key] = prefix_hashes(ids, self.block_size)
        return chain

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> list[list[RunningReplica]]:
        for r in candidate_replicas:   # the replicas' own accounts, as last pulled
            blocks = (r.routing_stats or {}).get("blocks")
            if blocks is not None:
                self.index.publish(r.replica_id, blocks)
        by_id = {r.replica_id: r for r in candidate_replicas}
        counts = state.ongoing()
        loads = {rid: counts.get(rid.unique_id, 0) for rid in by_id}
        if self.policy == "power-of-two":
            two = random.sample(list(by_id), min(2, len(by_id)))
            order = sorted(two, key=lambda r: loads[r])
            decision = Decision(order + [r for r in by_id if r not in two], "load")
        else:
            decision = self.index.choose(list(by_id), loads, self._chain(pending_request))
        if pending_request is not None:
            pending_request.routing_context.lmc_decision = decision   # counted once it is routed
            # every replica is ranked here: when all are full, Serve should wait before asking again
            pending_request.routing_context.should_backoff = True
        # one replica per rank: Serve tries the first, then the next if it is full
        return [[by_id[rid]] for rid in decision.order]

    def on_send_request(self, replica_id: ReplicaID) -> None:
        # counted as it is sent, before the next request is routed (``on_request_routed`` comes
        # only once the replica has answered that it takes it: a burst would all see old loads)
        super().on_send_request(replica_id)
        state.started(replica_id.unique_id)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        chain = self._chains.pop(pending_request.metadata.internal_request_id, [])
        decision = getattr(pending_request.routing_context, "lmc_decision", None)
        if decision is not None and chain:   # a generation (not the ingress asking a replica for the model's info)
            first = decision.order[0] if decision.order else None
            state.ROUTING_DECISIONS.labels(decision.reason if first == replica_id else "load").inc()
            if first == replica_id:
                state.ROUTED_CACHED_BLOCKS.inc(decision.matched_blocks)
        self.index.routed(replica_id, chain)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.forget(replica_id)
        state.forget(replica_id.unique_id)
