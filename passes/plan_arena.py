"""Liveness and arena planning: every intermediate gets an offset in one arena.

Values live from the node that defines them to their last reader (graph
outputs to the end). Offsets come from a best-fit placement tried in a few
orders (largest first, longest-lived first, definition order); the smallest
plan wins, as XLA's heap simulator does. Each plan reports its size next to
the lower bound (the most bytes live at one step) and the size without sharing.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ir.graph import Graph, Value
from ir.ops import get_op

from .dependency_groups import dependency_groups

ALIGN = 64  # a cache line: every buffer starts on one, so vector loads never split


@dataclass(frozen=True)
class Interval:
    name: str
    start: int   # index of the defining node
    end: int     # index of the last reader (inclusive)
    size: int    # bytes, rounded up to ALIGN


@dataclass
class ArenaPlan:
    offsets: dict[str, int]
    size: int
    lower_bound: int
    no_sharing: int
    intervals: list[Interval] = field(default_factory=list)
    strategy: str = ""

    def ratio(self) -> float:
        return self.size / self.lower_bound if self.lower_bound else 1.0


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def arena_values(graph: Graph) -> list[Value]:
    """Node results that need arena space (state updates alias their state)."""
    return [n.output for n in graph.nodes if not get_op(n.op).updates_state]


def inplace_roots(graph: Graph) -> dict[str, str]:
    """Value name -> the name of the buffer it lives in. An op that fills
    part of an input in place (``OpDef.inplace``, e.g. ``qmatmul_rows``)
    takes that input's buffer; chains of them share one."""
    root: dict[str, str] = {}
    for n in graph.nodes:
        op = get_op(n.op)
        i = op.inplace
        if i is not None and len(n.inputs) > i and n.inputs[i].kind == "node":
            src = n.inputs[i].name
            root[n.output.name] = root.get(src, src)
    return root


def liveness(graph: Graph, symbols: dict[str, int]) -> list[Interval]:
    """One interval per buffer (values updated in place share their root's).
    A value lives to the end of the group of ops its last reader belongs to
    (``passes.dependency_groups``): those ops run with no barrier
    between them, so none may reuse its bytes while a slower thread reads it."""
    groups = dependency_groups(graph)
    group_end = {g: i for i, g in enumerate(groups)}
    index = {id(n.output): i for i, n in enumerate(graph.nodes)}
    last: dict[int, int] = {}
    for i, n in enumerate(graph.nodes):
        for v in n.inputs:
            if id(v) in index:
                last[id(v)] = group_end[groups[i]]
    end_of_graph = len(graph.nodes)
    outs = {id(v) for v in graph.outputs}
    roots = inplace_roots(graph)
    spans: dict[str, list[int]] = {}
    for v in arena_values(graph):
        i = index[id(v)]
        end = end_of_graph if id(v) in outs else last.get(id(v), i)
        size = _align(v.type.nbytes(symbols))
        sp = spans.setdefault(roots.get(v.name, v.name), [i, end, size])
        sp[0], sp[1], sp[2] = min(sp[0], i), max(sp[1], end), max(sp[2], size)
    return [Interval(name, a, e, size) for name, (a, e, size) in spans.items()]


def lower_bound(intervals: list[Interval]) -> int:
    if not intervals:
        return 0
    steps = max(iv.end for iv in intervals) + 1
    live = [0] * (steps + 1)
    for iv in intervals:
        live[iv.start] += iv.size
        live[iv.end + 1] -= iv.size
    best = run = 0
    for d in live:
        run += d
        best = max(best, run)
    return best


def _best_fit(order: list[Interval]) -> tuple[dict[str, int], int]:
    placed: list[tuple[int, int, Interval]] = []  # (offset, end offset, interval)
    offsets: dict[str, int] = {}
    top = 0
    for iv in order:
        busy = sorted((o, e) for o, e, other in placed if not (other.end < iv.start or iv.end < other.start))
        best_off, best_gap = None, None
        cursor = 0
        for o, e in busy:
            gap = o - cursor
            if gap >= iv.size and (best_gap is None or gap < best_gap):
                best_off, best_gap = cursor, gap
            cursor = max(cursor, e)
        if best_off is None:
            best_off = cursor
        offsets[iv.name] = best_off
        placed.append((best_off, best_off + iv.size, iv))
        top = max(top, best_off + iv.size)
    return offsets, top


_ORDERS: dict[str, Callable[[Interval], tuple]] = {
    "size": lambda iv: (-iv.size, iv.start),
    "lifetime": lambda iv: (-(iv.end - iv.start), -iv.size),
    "size*lifetime": lambda iv: (-iv.size * (iv.end - iv.start + 1), iv.start),
    "definition": lambda iv: (iv.start, -iv.size),
}


def plan_arena(graph: Graph, symbols: dict[str, int] | None = None) -> ArenaPlan:
    """Offsets for every arena value of ``graph`` (symbolic dims bound by
    ``symbols``, e.g. the prefill chunk length)."""
    ivs = liveness(graph, symbols or {})
    best: ArenaPlan | None = None
    for name, key in _ORDERS.items():
        offsets, size = _best_fit(sorted(ivs, key=key))
        if best is None or size < best.size:
            best = ArenaPlan(offsets, size, lower_bound(ivs), sum(iv.size for iv in ivs), ivs, name)
    assert best is not None
    for v, r in inplace_roots(graph).items():
        best.offsets[v] = best.offsets[r]
    return best


def check_plan(plan: ArenaPlan) -> None:
    """No two values that are live at the same time overlap (used by tests)."""
    ivs = plan.intervals
    for i, a in enumerate(ivs):
        for b in ivs[i + 1:]:
            if a.end < b.start or b.end < a.start:
                continue
            oa, ob = plan.offsets[a.name], plan.offsets[b.name]
            if oa < ob + b.size and ob < oa + a.size:
                raise AssertionError(f"{a.name} and {b.name} overlap in the arena")
