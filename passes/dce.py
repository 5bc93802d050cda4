"""Dead code elimination: drop nodes nothing reads (state updates are kept)."""
from __future__ import annotations

from ir.graph import Graph
from ir.ops import get_op

from .registry import register_pass


@register_pass("dce")
def dce(graph: Graph) -> Graph:
    """Remove nodes whose results are never used, and weights no node reads."""
    live = {id(v) for v in graph.outputs}
    kept = []
    for node in reversed(graph.nodes):
        if id(node.output) in live or get_op(node.op).updates_state:
            kept.append(node)
            live.update(id(v) for v in node.inputs)
    graph.nodes = kept[::-1]
    graph.weights = {k: v for k, v in graph.weights.items() if id(v) in live}
    return graph
