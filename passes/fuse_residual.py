"""fuse_residual: a residual add or a bias becomes the epilogue of the matmul before it.

``add(r, qmatmul(x, w))`` (the attention output and FFN down projections of
most architectures) and ``bias_add(qmatmul(x, w), b)`` (Qwen2's q, k and v)
are each one kernel call, one pass over the result and, on several
threads, one barrier more than the product alone. Where the product
runs on a repacked weight (``passes/repack``: one kernel for every row
count) and nothing else reads it, the pair becomes ``qmatmul_add(x, w, r)``:
each tile of output rows gets the residual (or the bias) added while it is
still in L1.
float32 addition commutes, so the result is the add's, bit for bit
(``ir.ops.qmatmul_add_ref``). Other weights (the float path, streamed
weights, QSF) keep the two ops: only the repacked kernel has the epilogue.
"""
from __future__ import annotations

from ir.graph import Graph, Value
from ir.ops import ShapeError, get_op

from .registry import register_pass
from .uses import Uses


def _addend_fits(x: Value, w: Value, r: Value, attrs: dict) -> bool:
    """Whether ``qmatmul_add(x, w, r)`` is well typed: r the product's type
    (a residual) or a float32 vector of its row length (a bias); its shape
    rule decides, so the pass and the op cannot disagree."""
    try:
        get_op("qmatmul_add").infer([x.type, w.type, r.type], attrs)
    except ShapeError:
        return False
    return True


@register_pass("fuse_residual")
def fuse_residual(graph: Graph) -> Graph:
    """add(r, qmatmul(x, w)), bias_add(qmatmul(x, w), b) -> qmatmul_add on repacked weights."""
    uses = Uses(graph)
    fused: set[int] = set()      # ids of the products folded into an add
    for node in graph.nodes:
        if node.op not in ("add", "bias_add"):
            continue
        for i, v in enumerate(node.inputs if node.op == "add" else node.inputs[:1]):
            mm = uses.only_for(v)
            r = node.inputs[1 - i]
            if (mm is None or mm.op != "qmatmul"
                    or not mm.inputs[1].type.repack or r is v
                    or not _addend_fits(*mm.inputs[:2], r, mm.attrs)):
                continue
            node.op = "qmatmul_add"
            node.inputs = [mm.inputs[0], mm.inputs[1], r]
            node.attrs, node.kernel = dict(mm.attrs), dict(mm.kernel)
            fused.add(id(mm))
            break
    graph.nodes = [n for n in graph.nodes if id(n) not in fused]
    return graph
