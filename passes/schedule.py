"""schedule: put ops that do not depend on each other next to each other.

Native code needs a barrier only between dependent ops (``passes.barriers``):
a layer written as q = x Wq, q + bq, k = x Wk, k + bk ... has a dependency
at every other op, while q, k, v (then their biases, then their RoPEs) have
none among them. This pass builds the groups greedily in program order: each
group takes every op, among the next ``WINDOW`` not yet placed, whose inputs
come from earlier groups and whose state buffers (KV caches) no other op of
the group touches. Ops only move past independent ops a few places, so the
memory plan hardly changes; the interpreter runs the reordered graph to the
same numbers (each op sees the same inputs).
"""
from __future__ import annotations

from ir.graph import Graph

from .dependency_groups import touched_states
from .registry import register_pass

#: how far ahead an op may be pulled into the current group
WINDOW = 8


@register_pass("schedule")
def schedule(graph: Graph) -> Graph:
    nodes = list(graph.nodes)
    states = {id(n): s for n, s in zip(nodes, touched_states(graph))}
    producer = {id(n.output) for n in nodes}
    done: set[int] = set()          # results of ops in earlier groups
    order = []
    remaining = nodes
    while remaining:
        group, rest = [], []
        busy: set[str] = set()      # states touched by the group or by an op left behind
        for n in remaining[:WINDOW]:
            ready = all(id(v) in done or id(v) not in producer for v in n.inputs) and not states[id(n)] & busy
            (group if ready else rest).append(n)
            busy |= states[id(n)]
        order += group
        done.update(id(n.output) for n in group)
        remaining = rest + remaining[WINDOW:]
    graph.nodes = order
    return graph
