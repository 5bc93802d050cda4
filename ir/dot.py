"""DOT export: the graph as Graphviz text (rendering lives in the CLI).

Ops are boxes labelled with op and type; weights are notes, state is a
cylinder, inputs/outputs are ovals, so what is data and what is computation
reads at a glance.
"""
from __future__ import annotations

import networkx as nx

from .graph import Graph
from .printer import ref


def _q(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def to_networkx(graph: Graph) -> nx.DiGraph:
    """Values and nodes as one directed graph (edges follow data)."""
    g = nx.DiGraph()
    for v in graph.inputs:
        g.add_node(ref(v), kind="input", label=f"{v.name}\n{v.type}")
    for v in graph.weights.values():
        g.add_node(ref(v), kind="weight", label=f"{v.name}\n{v.type}")
    for v in graph.states.values():
        g.add_node(ref(v), kind="state", label=f"{v.name}\n{v.type}")
    for node in graph.nodes:
        label = node.op + (f"[{node.attrs['layout']}]" if "layout" in node.attrs else "")
        g.add_node(ref(node.output), kind="op", label=f"{label}\n{node.output.type}")
        for v in node.inputs:
            g.add_edge(ref(v), ref(node.output))
    for v in graph.outputs:
        g.add_node("out:" + v.name, kind="output", label=f"output {v.name}")
        g.add_edge(ref(v), "out:" + v.name)
    return g


_STYLE = {
    "input": 'shape=oval, style=filled, fillcolor="#cde4ff"',
    "output": 'shape=oval, style=filled, fillcolor="#cde4ff"',
    "weight": 'shape=note, style=filled, fillcolor="#f3e6c4", fontsize=9',
    "state": 'shape=cylinder, style=filled, fillcolor="#d7f0d2"',
    "op": 'shape=box, style="rounded,filled", fillcolor="#ffffff"',
}


def to_dot(graph: Graph) -> str:
    g = to_networkx(graph)
    lines = [f"digraph {_q(graph.name)} {{", "  rankdir=TB;", '  node [fontname="Helvetica"];']
    for n, data in g.nodes(data=True):
        lines.append(f"  {_q(n)} [label={_q(data['label'])}, {_STYLE[data['kind']]}];")
    for a, b in g.edges():
        lines.append(f"  {_q(a)} -> {_q(b)};")
    lines.append("}")
    return "\n".join(lines) + "\n"
