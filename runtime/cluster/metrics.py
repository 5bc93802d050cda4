"""``/metrics`` of ``lmc serve --replicas``: the ingress's own counters
(refused requests, routing decisions, retries) and every replica's engine
metrics with a ``replica`` label, from the stats each replica last
published to the router (``routing_state.ROUTERS``)."""
from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from . import routing_state

#: a replica's families the ingress reports itself (replicas answer no HTTP)
_INGRESS_ONLY = {"lmc_http_errors"}


class ReplicaMetrics(Collector):
    """Every replica's metric families, one ``replica`` label apart."""

    def __init__(self, stats: Callable[[], dict[str, dict]]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for rid, st in sorted(self.stats().items()):
            for fam in text_string_to_metric_families(st.get("metrics") or ""):
                if fam.name in _INGRESS_ONLY:
                    continue
                out = families.get(fam.name)
                if out is None:
                    out = families[fam.name] = Metric(fam.name, fam.documentation, fam.type)
                for s in fam.samples:
                    out.add_sample(s.name, {**s.labels, "replica": rid}, s.value, s.timestamp, s.exemplar)
        yield from families.values()
        where = Metric("lmc_replica", "Engine replicas the router sees: 1 per replica, its process and host as labels",
                       "gauge")
        for rid, st in sorted(self.stats().items()):
            if "pid" in st:
                where.add_sample("lmc_replica", {"replica": rid, "pid": str(st["pid"]), "host": st.get("host", "")}, 1)
        yield where


class _Same(Collector):
    def __init__(self, registry: CollectorRegistry) -> None:
        self.source = registry

    def collect(self) -> Iterator[Metric]:
        yield from self.source.collect()


def all_replica_stats() -> dict[str, dict]:
    out: dict[str, dict] = {}
    for r in list(routing_state.ROUTERS):
        out.update(r.replica_stats())
    return out


class IngressMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.http_errors = Counter("lmc_http_errors", "Requests refused with a 4xx answer", ["status"], registry=r)
        self.retried = Counter("lmc_replica_retries", "Requests sent again to another replica after theirs died "
                               "before their first token", registry=r)
        self.failed = Counter("lmc_replica_failures", "Requests cut because their replica died after streaming "
                              "had begun", registry=r)
        self.replicas = Gauge("lmc_replicas", "Engine replicas the router sees", registry=r)
        self.replicas.set_function(lambda: len(all_replica_stats()))
        r.register(_Same(routing_state.REGISTRY))   # the router's decisions (Serve builds the router, not us)
        r.register(ReplicaMetrics(all_replica_stats))

    def text(self) -> bytes:
        return generate_latest(self.registry)
