"""fuse_elementwise: a gated FFN's act(gate) * up becomes one ``glu`` op, and
the keys' RoPE and their KV-cache write one ``rope_kv_write`` op.

Every elementwise op is a kernel call, a pass over its operands' memory and
(on several threads) a barrier; in a decode step they cost more in calls
and barriers than in arithmetic. ``mul(act(g), u)`` with ``act`` SiLU or
GELU and nothing else reading ``act(g)`` is rewritten to ``glu(g, u)``: the
same float32 operations in the same order (``ir.ops.glu_ref``), one kernel
that reads g and u once and never writes act(g) out. Likewise
``kv_write(c, rope(k, pos), pos)`` (and its paged form) with nothing else
reading ``rope(k)`` becomes ``rope_kv_write(c, k, pos)``: the rotated keys
go straight into the cache rows, rounded as kv_write rounds them
(``ir.ops.rope_kv_write_ref``). The two rewrites are also passes of their
own (``fuse_glu``, ``fuse_rope_kv``) so either can be compared on and off.
"""
from __future__ import annotations

from ir.graph import Graph, Node
from ir.ops import GLU_ACTS
from ir.quant import quant_type

from .registry import register_pass
from .uses import Uses

#: kv_write op -> the fused op that also rotates its rows
ROPE_KV_OPS = {"kv_write": "rope_kv_write", "kv_write_paged": "rope_kv_write_paged"}


@register_pass("fuse_glu")
def fuse_glu(graph: Graph) -> Graph:
    """mul(act(g), u) -> glu(g, u) where nothing else reads act(g)."""
    uses = Uses(graph)
    fused: set[int] = set()      # ids of the activation nodes folded into a glu
    for node in graph.nodes:
        if node.op != "mul":
            continue
        for i, v in enumerate(node.inputs):
            act = uses.only_for(v)
            if act is not None and act.op in GLU_ACTS and act.output.type.shape == node.output.type.shape:
                node.op = "glu"
                node.inputs = [act.inputs[0], node.inputs[1 - i]]
                node.attrs = {"activation": act.op}
                fused.add(id(act))
                break
    graph.nodes = [n for n in graph.nodes if id(n) not in fused]
    return graph


def _rope_fits(rope: Node, write: Node) -> bool:
    """The rope rotates at the positions the write stores at, as f32 rows,
    and a q8 (or q4, q2) cache's blocks do not straddle heads (the kernel quantizes a
    rotated head at a time)."""
    x, pos = rope.inputs[:2]
    cache = write.inputs[0].type
    if pos is not write.inputs[2] or x.type.dtype != "f32" or (x.type.layout or "F32") != "F32":
        return False
    if (write.op == "kv_write" and pos.type.rank != 0) or write.attrs.get("sink"):   # (rope_kv_write keeps no sink)
        return False
    return cache.layout is None or int(rope.attrs["head_dim"]) % quant_type("Q8_0").block == 0


@register_pass("fuse_rope_kv")
def fuse_rope_kv(graph: Graph) -> Graph:
    """kv_write(c, rope(k, pos), pos) -> rope_kv_write(c, k, pos) (paged too) where nothing else reads rope(k)."""
    uses = Uses(graph)
    fused: set[int] = set()      # ids of the rope nodes folded into a rope_kv_write
    for node in graph.nodes:
        if node.op not in ROPE_KV_OPS:
            continue
        rope = uses.only_for(node.inputs[1])
        if rope is None or rope.op != "rope" or not _rope_fits(rope, node):
            continue
        x, _pos, *factors = rope.inputs
        node.inputs = [node.inputs[0], x, *node.inputs[2:], *factors]
        node.attrs = {**node.attrs, **rope.attrs}
        node.op = ROPE_KV_OPS[node.op]
        fused.add(id(rope))
    graph.nodes = [n for n in graph.nodes if id(n) not in fused]
    return graph


@register_pass("fuse_elementwise")
def fuse_elementwise(graph: Graph) -> Graph:
    """fuse_glu, then fuse_rope_kv."""
    return fuse_rope_kv(fuse_glu(graph))
