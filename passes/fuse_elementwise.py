"""fuse_elementwise: a gated FFN's act(gate) * up becomes one ``glu`` op.

Every elementwise op is a kernel call, a pass over its operands' memory and
(on several threads) a barrier; in a decode step they cost more in calls
and barriers than in arithmetic. ``mul(act(g), u)`` with ``act`` SiLU or
GELU and nothing else reading ``act(g)`` is rewritten to ``glu(g, u)``: the
same float32 operations in the same order (``ir.ops.glu_ref``), one kernel
that reads g and u once and never writes act(g) out.
"""
from __future__ import annotations

from collections import Counter

from ir.graph import Graph
from ir.ops import GLU_ACTS

from .registry import register_pass


@register_pass("fuse_elementwise")
def fuse_elementwise(graph: Graph) -> Graph:
    readers = Counter(id(v) for n in graph.nodes for v in n.inputs)
    outputs = {id(v) for v in graph.outputs}
    made_by = {id(n.output): n for n in graph.nodes}
    fused: set[int] = set()      # ids of the activation nodes folded into a glu
    for node in graph.nodes:
        if node.op != "mul":
            continue
        for i, v in enumerate(node.inputs):
            act = made_by.get(id(v))
            if (act is not None and act.op in GLU_ACTS and readers[id(v)] == 1 and id(v) not in outputs
                    and act.output.type.shape == node.output.type.shape):
                node.op = "glu"
                node.inputs = [act.inputs[0], node.inputs[1 - i]]
                node.attrs = {"activation": act.op}
                fused.add(id(act))
                break
    graph.nodes = [n for n in graph.nodes if id(n) not in fused]
    return graph

