"""One node as the viewer shows it: op, operands and result with their
types and layouts, attributes and kernel choices, the block it belongs to,
who reads it, and the signature its kernel is specialised on.

Blocks come from ``ir.layers`` (the same cut the pictures draw), so a node
clicked in a picture and its "layer" here agree.
"""
from __future__ import annotations

from typing import Any

from compiler.codegen.kernels import KernelSig
from ir.graph import Graph, Node, Value
from ir.layers import EMBED, count_layers, node_sections, section_nodes
from ir.printer import layout_label, print_node


def section_name(section: int, n_layers: int) -> str | int:
    """A block's number, or "embedding" / "head"."""
    return "embedding" if section == EMBED else "head" if section == n_layers else section


def _json_value(v: Any) -> Any:
    return v if isinstance(v, (bool, int, float, str)) or v is None else str(v)


def value_info(v: Value) -> dict[str, Any]:
    t = v.type
    out = {"ref": v.sigil + v.name, "name": v.name, "kind": v.kind, "type": str(t), "dtype": t.dtype,
           "shape": [d if isinstance(d, int) else str(d) for d in t.shape], "layout": t.layout,
           "stored": t.stored}
    if t.is_static:
        out["bytes"] = t.nbytes()
    else:   # a prompt chunk's activation: its size for one token
        out["bytes_per_token"] = t.nbytes({"T": 1})
    if v.producer is not None:
        out["producer"] = {"name": v.producer.output.name, "op": v.producer.op}
    if v.ref is not None:
        out["file_offset"], out["file_bytes"] = v.ref.offset, v.ref.nbytes
    return out


def kernel_signature(node: Node) -> dict[str, Any]:
    """The kernel this node calls: its symbol and what it is specialised on."""
    sig = KernelSig.of(node)
    return {"name": sig.name, "op": sig.op, "in_types": [str(t) for t in sig.in_types],
            "out_type": str(sig.out_type), "attrs": {k: _json_value(v) for k, v in sig.attrs}}


class GraphIndex:
    """A step's graph with its nodes by name, their blocks and readers."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.n_layers = count_layers(graph)
        self.sections = node_sections(graph)
        self.by_name = {n.output.name: n for n in graph.nodes}
        self.position = {n.output.name: i for i, n in enumerate(graph.nodes)}
        self.users = graph.users()

    def layer(self, node: Node) -> str | int:
        return section_name(self.sections[id(node)], self.n_layers)

    def summary(self, node: Node) -> dict[str, Any]:
        """The short form: what a list of nodes shows."""
        layout = layout_label(node)
        return {"name": node.output.name, "op": node.op, "label": node.op + (f"[{layout}]" if layout else ""),
                "layer": self.layer(node), "index": self.position[node.output.name], "type": str(node.output.type)}

    def describe(self, node: Node) -> dict[str, Any]:
        """Everything the node panel shows."""
        readers = [{"name": u.output.name, "op": u.op} for u in self.users.get(id(node.output), [])]
        return {**self.summary(node), "text": print_node(node),
               "inputs": [value_info(v) for v in node.inputs], "output": value_info(node.output),
               "attrs": {k: _json_value(v) for k, v in sorted(node.attrs.items())},
               "kernel_choices": {k: _json_value(v) for k, v in sorted(node.kernel.items())},
               "readers": readers, "is_output": any(v is node.output for v in self.graph.outputs),
               "signature": kernel_signature(node)}

    def overview_peers(self) -> dict[str, list[str]]:
        """Block 0's nodes -> the same node of every block (the overview
        draws block 0 for all): same position in a block of the same ops."""
        by = section_nodes(self.graph, self.sections)
        rep = by.get(0, [])
        peers: dict[str, list[str]] = {n.output.name: [n.output.name] for n in rep}
        for layer in range(1, self.n_layers):
            nodes = by.get(layer, [])
            if [n.op for n in nodes] != [n.op for n in rep]:
                continue
            for r, n in zip(rep, nodes):
                peers[r.output.name].append(n.output.name)
        return peers
