"""Which ops touch the same memory through their data alone: a node's
state buffers, and groups of consecutive ops none of which reads another's
result or shares a state buffer with it. The barrier planner
(``barriers``) needs no barrier inside a group; the arena planner
(``plan_arena``) keeps a value alive to the end of the group that last
reads it; the scheduler (``schedule``) moves ops within these rules."""
from __future__ import annotations

from ir.graph import Graph, Value
from ir.ops import get_op


def _state_of(v: Value, roots: dict[int, str]) -> str | None:
    """The state buffer a value lives in (a state, or a state op's result)."""
    return v.name if v.kind == "state" else roots.get(id(v))


def touched_states(graph: Graph) -> list[set[str]]:
    """Per node, the state buffers it reads or writes."""
    roots: dict[int, str] = {}
    out: list[set[str]] = []
    for n in graph.nodes:
        touched = {s for s in (_state_of(v, roots) for v in n.inputs) if s}
        if get_op(n.op).updates_state:
            s = _state_of(n.inputs[0], roots)
            if s:
                roots[id(n.output)] = s
                touched.add(s)
        out.append(touched)
    return out


def dependency_groups(graph: Graph) -> list[int]:
    """A group number per node, in order: a node opens a new group when it
    reads a result of its group or touches a state buffer the group touches.
    The ops of a group need no barrier between them as far as their data
    goes; the arena planner keeps every value a group reads alive to the
    group's end, so reused arena bytes add none either."""
    states = touched_states(graph)
    groups: list[int] = []
    made: set[int] = set()
    seen_states: set[str] = set()
    g = 0
    for i, n in enumerate(graph.nodes):
        if groups and (any(id(v) in made for v in n.inputs) or states[i] & seen_states):
            g += 1
            made, seen_states = set(), set()
        groups.append(g)
        made.add(id(n.output))
        seen_states |= states[i]
    return groups
