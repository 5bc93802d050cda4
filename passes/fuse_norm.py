"""fuse_norm: an RMSNorm whose result only feeds repacked matmuls is computed
inside their activation quantization.

A layer's attention norm feeds its q, k and v projections, the FFN norm its
gate and up projections. On the integer path each of those matmuls begins
by quantizing its input row (every thread the whole row, ``matmul/repacked``),
so the normalized row need never be written out: each matmul reads the
un-normalized row, normalizes it into its scratch with the rmsnorm kernel's
own code (``k_norm_rope.emit_rmsnorm_row``) and quantizes that. The norm's
kernel call and, on several threads, its barrier go away (two of each per
layer in a decode step); the norm's arithmetic, a few hundred nanoseconds a
row, is done by each reader instead of once.

``rmsnorm(x, g)`` read by nothing but the x operand of ``qmatmul`` or
``qmatmul_add`` nodes on repacked weights, with g spanning whole rows (not a
per-head norm) and not a graph output, is removed; each reader gets x, the
attribute ``norm_eps`` and g as its last operand (``ir.ops.qmatmul_ref``:
``rmsnorm_ref`` then the product, the two ops' numbers).
"""
from __future__ import annotations

from ir.graph import Graph, Node

from .registry import register_pass
from .uses import Uses

#: the ops that can take the norm into their quantization
READERS = ("qmatmul", "qmatmul_add")


def _takes_norm(node: Node, v_id: int) -> bool:
    """Whether ``node`` reads the value only as its x and can normalize it itself."""
    return (node.op in READERS and "norm_eps" not in node.attrs and node.attrs.get("act") is not None
            and node.inputs[1].type.repack
            and id(node.inputs[0]) == v_id and all(id(v) != v_id for v in node.inputs[1:]))


@register_pass("fuse_norm")
def fuse_norm(graph: Graph) -> Graph:
    """rmsnorm(x, g) read only by repacked matmuls -> each normalizes x itself before quantizing it."""
    uses = Uses(graph)
    fused: set[int] = set()
    for node in graph.nodes:
        if node.op != "rmsnorm":
            continue
        x, g = node.inputs
        v = node.output
        readers = uses.read_by.get(id(v), [])
        if (not readers or id(v) in uses.outputs or g.type.shape[0] != x.type.shape[-1]
                or not all(_takes_norm(r, id(v)) for r in readers)):
            continue
        for r in readers:
            r.inputs = [x, *r.inputs[1:], g]
            r.attrs = {**r.attrs, "norm_eps": float(node.attrs["eps"])}
        fused.add(id(node))
    graph.nodes = [n for n in graph.nodes if id(n) not in fused]
    return graph
