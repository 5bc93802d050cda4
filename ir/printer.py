"""The stable text form of a graph: one node a line, like MLIR or TVMScript.

    %12 = qmatmul[Q4_K](%11, @blk.3.ffn_up) : f32[2048]

Attributes print sorted by name; ``layout`` goes in brackets after the op.
Tests and ``--dump-after`` diffs rely on this form staying put.
"""
from __future__ import annotations

from typing import Any

from .graph import Graph, Node, Value


def _fmt_attr(v: Any) -> str:
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, str):
        return v
    return str(v)


def ref(v: Value) -> str:
    return f"{v.sigil}{v.name}"


def layout_label(node: Node) -> str | None:
    """What a node's brackets show: its ``layout`` attribute, with the tile
    width of a repacked weight operand (``qmatmul[Q5_0x16]``)."""
    if "layout" not in node.attrs:
        return None
    w = node.inputs[1].type if len(node.inputs) > 1 else None
    if w is not None and w.repack and w.layout == node.attrs["layout"]:
        return w.stored
    return node.attrs["layout"]


def print_node(node: Node) -> str:
    """One line; the kernel choices print among the attributes."""
    attrs = {k: v for k, v in {**node.attrs, **node.kernel}.items() if k != "layout"}
    head = node.op + (f"[{layout_label(node)}]" if "layout" in node.attrs else "")
    args = ", ".join(ref(v) for v in node.inputs)
    tail = ""
    if attrs:
        tail = " {" + ", ".join(f"{k}={_fmt_attr(attrs[k])}" for k in sorted(attrs)) + "}"
    return f"{ref(node.output)} = {head}({args}){tail} : {node.output.type}"


def print_graph(graph: Graph) -> str:
    lines = [f"graph {graph.name}("
             + ", ".join(f"{ref(v)}: {v.type}" for v in graph.inputs) + ") {"]
    for v in graph.weights.values():
        r = v.ref
        src = f"file({r.path.rsplit('/', 1)[-1]!r}, offset={r.offset}, bytes={r.nbytes})"
        if r.packed is not None and r.packed.codec == "repack":   # built at load from the file's bytes
            p = r.packed
            src = (f"repacked(file({r.path.rsplit('/', 1)[-1]!r}, offset={p.file_offset}, bytes={p.stored}), "
                   f"image_offset={r.offset}, bytes={r.nbytes})")
        lines.append(f"  weight {ref(v)} : {v.type} = {src}")
    for v in graph.states.values():
        lines.append(f"  state {ref(v)} : {v.type}")
    for node in graph.nodes:
        lines.append("  " + print_node(node))
    lines.append("  return " + ", ".join(ref(v) for v in graph.outputs))
    lines.append("}")
    return "\n".join(lines) + "\n"
