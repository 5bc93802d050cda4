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
