"""fuse_dequant: ``matmul(x, dequant(W))`` becomes ``qmatmul[layout](x, W)``.

The fused op reads the stored blocks and dequantizes in registers, so no
dequantized weight matrix ever exists.
"""
from __future__ import annotations

from ir.graph import Graph

from .dce import dce
from .registry import register_pass


@register_pass("fuse_dequant")
def fuse_dequant(graph: Graph) -> Graph:
    """Fold each dequant feeding a matmul into a quantized matmul."""
    for node in graph.nodes:
        if node.op != "matmul":
            continue
        w = node.inputs[1]
        prod = w.producer
        if prod is None or prod.op != "dequant":
            continue
        stored = prod.inputs[0]
        node.op = "qmatmul"
        node.inputs = [node.inputs[0], stored]
        node.attrs = {**node.attrs, "layout": stored.type.layout}
    return dce(graph)
