"""split_rows: a quantized matmul on a weight too large to hold becomes a
chain of ``qmatmul_rows`` ops over row blocks of that weight.

The memory planner (``passes/memory_budget``) asks for it when a weight
(typically the output head: Gemma's 262144 x 640 table is 178 MB) must be
streamed from disk but is larger than a stream buffer. Each block is its own
weight (a byte range of the file), so the stream schedule can read it into a
buffer like a layer. The blocks fill one result buffer in place, so the
split costs no copy. Which weights, and how many rows per block, come from
``graph.meta["split_rows"]`` = {weight name: rows per block}.
"""
from __future__ import annotations

from ir.graph import Graph, Node, Value, WeightRef
from ir.quant import PlanarQ8Layout, get_layout
from ir.types import TensorType

from .dce import dce
from .registry import register_pass


def row_bytes(t: TensorType) -> int | None:
    """Bytes of one stored row, when rows are whole byte ranges (block
    layouts, F32, F16); None for layouts that keep scales elsewhere."""
    if t.rank != 2:
        return None
    n = int(t.shape[0])
    if t.repack:   # W-row tiles, each a contiguous run of bytes (``passes/repack``)
        return t.nbytes() // n if n % t.repack == 0 else None
    if isinstance(get_layout(t.layout or "F32"), PlanarQ8Layout):
        return None  # llama2.c Q8: the scales follow all the quants
    rb = TensorType((1, t.shape[1]), t.dtype, t.layout).nbytes()
    return rb if rb * n == t.nbytes() else None


def block_name(weight: str, r0: int, r1: int) -> str:
    return f"{weight}[{r0}:{r1}]"


@register_pass("split_rows")
def split_rows(graph: Graph) -> Graph:
    """Split the qmatmuls named in graph.meta["split_rows"] into row blocks."""
    plan: dict[str, int] = graph.meta.get("split_rows") or {}
    if not plan:
        return graph
    old = graph.nodes
    graph.nodes = []
    for node in old:
        w = node.inputs[1] if node.op in ("qmatmul", "matmul") else None
        if w is None or w.kind != "weight" or w.name not in plan:
            graph.nodes.append(node)
            continue
        _split(graph, node, w, int(plan[w.name]))
    return dce(graph)  # drops the whole weight unless another op (a tied embedding) reads it


def _split(graph: Graph, node: Node, w: Value, rows: int) -> None:
    n = int(w.type.shape[0])
    rb = row_bytes(w.type)
    if rb is None:
        raise ValueError(f"split_rows: {w.name} ({w.type.layout}) cannot be split by rows")
    if w.type.repack and rows % w.type.repack:
        raise ValueError(f"split_rows: blocks of {rows} rows cut {w.name}'s tiles of {w.type.repack}")
    x, attrs = node.inputs[0], {k: v for k, v in node.attrs.items() if k != "norm_eps"}
    if "norm_eps" in node.attrs:   # a fused norm (``passes/fuse_norm``) is computed once for all blocks again:
        # the same numbers, since the fused kernel normalizes with the norm's own code
        x = graph.add_node("rmsnorm", [x, node.inputs[-1]], {"eps": node.attrs["norm_eps"]})
    acc: Value | None = None
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        t = TensorType((r1 - r0, w.type.shape[1]), w.type.dtype, w.type.layout, w.type.repack)
        # a repacked weight's block keeps its region: its bytes are in the image (or its file)
        ref = WeightRef(w.ref.path, w.ref.offset + r0 * rb, (r1 - r0) * rb, w.ref.packed)
        part = graph.add_weight(block_name(w.name, r0, r1), t, ref)
        block_attrs = {**attrs, "layout": w.type.layout, "row0": r0, "n_total": n}
        inputs = [x, part] + ([acc] if acc is not None else [])
        last = r1 == n
        acc = graph.add_node("qmatmul_rows", inputs, block_attrs, name=node.output.name if last else None,
                             kernel=node.kernel)
    # the last block's value stands in for the original result
    assert acc is not None and acc.producer is not None
    final = acc.producer
    node.output.producer = None
    final.output = node.output
    node.output.producer = final
