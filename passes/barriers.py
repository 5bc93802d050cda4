"""Which ops of a planned graph must wait at a barrier for the ones before.

Native steps run every op on all threads, each thread on its share of the
op's work; a barrier between two ops makes every thread finish the first
before any starts the second. That is needed only when the second touches
memory the first touches: it reads what the first writes, or writes what
the first reads or writes (the arena reuses a dead value's bytes). Ops with
no such overlap (the Q, K and V projections of one input, a layer's biases)
can follow each other with no barrier: a thread that finishes its share of
one goes straight on to the next. Kernels keep no state between calls but
their own thread's scratch, so the memory an op touches is its operands
and its result: arena ranges, whole state buffers (a KV cache update
aliases its cache), never weights or graph inputs, which only get read.
"""
from __future__ import annotations

from ir.graph import Graph, Value
from ir.ops import get_op

from .plan_arena import ArenaPlan, inplace_roots

#: a memory range: ("arena", start, end) or ("state", name)
Region = tuple


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


def _regions(graph: Graph, plan: ArenaPlan) -> dict[int, Region]:
    """The memory each value written by some op lives in (by id of the value)."""
    roots = inplace_roots(graph)
    sizes = {iv.name: iv.size for iv in plan.intervals}
    out: dict[int, Region] = {}
    for v in graph.states.values():
        out[id(v)] = ("state", v.name)
    for n in graph.nodes:
        if get_op(n.op).updates_state:
            out[id(n.output)] = out.get(id(n.inputs[0]), ("state", n.inputs[0].name))
        else:
            name = n.output.name
            start = plan.offsets[name]
            out[id(n.output)] = ("arena", start, start + sizes[roots.get(name, name)])
    return out


def _overlap(a: Region, b: Region) -> bool:
    if a[0] != b[0]:
        return False
    if a[0] == "state":
        return a[1] == b[1]
    return a[1] < b[2] and b[1] < a[2]


def barrier_before(graph: Graph, plan: ArenaPlan) -> list[bool]:
    """needs[i]: op i must wait until every thread has finished the ops since
    the last barrier. The first op never needs one (the step starts together)."""
    regions = _regions(graph, plan)

    def touched(vs: list[Value]) -> list[Region]:
        return [regions[id(v)] for v in vs if id(v) in regions]

    needs: list[bool] = []
    reads: list[Region] = []
    writes: list[Region] = []
    for n in graph.nodes:
        r, w = touched(list(n.inputs)), touched([n.output])
        clash = (any(_overlap(a, b) for a in r for b in writes)
                 or any(_overlap(a, b) for a in w for b in reads + writes))
        needs.append(bool(needs) and clash)
        if clash:
            reads, writes = [], []
        reads += r
        writes += w
    return needs


def barrier_count(graph: Graph, plan: ArenaPlan) -> int:
    """Barriers one step of ``graph`` meets (the one ending the step included)."""
    return sum(barrier_before(graph, plan)) + 1
