"""Which transformer block each node belongs to, read off the graph itself.

Pictures of a whole model (``lmc ir --overview``, ``--layer N``) need to cut
the graph into the embedding, the N blocks and the head. Nodes carry no
layer attribute (it would leak into the stable text form and every pass
would have to keep it), but the weights and KV cache states they read are
named per block (``blk.3.ffn_up``, ``k_cache.3``), and data flows forward, so
the section of every node follows from a few rules:

1. a node that reads a block's weight or state is in that block;
2. a node that reads another weight (``token_embd``, ``output_norm``) is in
   the embedding if nothing upstream is in a block, else in the head;
3. any other node is in the latest section among its inputs;
4. then, walking backwards: a node that reads only weights (``dequant``)
   sits with its consumers, and a one-input node that reads no weight and
   feeds only the head (``take_last``) is part of the head.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .graph import Graph, Node, Value

#: the section before the first block; the head is section ``n_layers``
EMBED = -1

_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.|^[kv]_(?:cache|recent)\.(\d+)$")


def block_of(name: str) -> int | None:
    """The block a weight or state name belongs to (GGUF-style names), or None."""
    m = _BLOCK_NAME.match(name)
    if m is None:
        return None
    return int(m.group(1) if m.group(1) is not None else m.group(2))


def count_layers(graph: Graph) -> int:
    """Number of transformer blocks: one past the highest block index named."""
    idx = [block_of(n) for n in (*graph.weights, *graph.states)]
    return max((i for i in idx if i is not None), default=-1) + 1


def _consts(node: Node) -> list[Value]:
    return [v for v in node.inputs if v.kind in ("weight", "state")]


def _acts(node: Node) -> list[Value]:
    return [v for v in node.inputs if v.kind == "node"]


def node_sections(graph: Graph) -> dict[int, int]:
    """id(node) -> section: ``EMBED``, block ``0..N-1`` or the head ``N``."""
    head = count_layers(graph)
    sec: dict[int, int] = {}     # id(value) -> section of the node producing it
    out: dict[int, int] = {}
    for node in graph.nodes:
        consts = _consts(node)
        blocks = [b for b in (block_of(v.name) for v in consts) if b is not None]
        upstream = max((sec.get(id(v), EMBED) for v in _acts(node)), default=EMBED)
        if blocks:
            s = max(blocks)
        elif consts:
            s = head if upstream > EMBED else EMBED
        else:
            s = upstream
        sec[id(node.output)] = out[id(node)] = s
    users = graph.users()
    for node in reversed(graph.nodes):
        targets = {out[id(u)] for u in users.get(id(node.output), [])}
        if len(targets) != 1:
            continue
        t = targets.pop()
        acts, consts = _acts(node), _consts(node)
        if not acts and consts and len(consts) == len(node.inputs):
            out[id(node)] = t
        elif t == head and not consts and len(acts) == 1:
            out[id(node)] = t
    return out


def section_nodes(graph: Graph, sections: dict[int, int]) -> dict[int, list[Node]]:
    """section -> its nodes, in graph order."""
    by: dict[int, list[Node]] = {}
    for node in graph.nodes:
        by.setdefault(sections[id(node)], []).append(node)
    return by


@dataclass
class LayerVariation:
    """How blocks differ from the one an overview draws: attribute names
    that change (``window``, ``theta``, ``layout`` …), by which layers, and
    layers whose op sequence is different altogether."""

    attrs: dict[str, list[int]]
    structure: list[int]


def layer_variation(graph: Graph, sections: dict[int, int], shown: int = 0) -> LayerVariation:
    """Compare every block with block ``shown``, op by op."""
    by = section_nodes(graph, sections)
    ref = by.get(shown, [])
    attrs: dict[str, list[int]] = {}
    structure: list[int] = []
    for layer in range(count_layers(graph)):
        if layer == shown:
            continue
        nodes = by.get(layer, [])
        if [n.op for n in nodes] != [n.op for n in ref]:
            structure.append(layer)
            continue
        for a, b in zip(ref, nodes):
            keys = {k for k in set(a.attrs) | set(b.attrs) if a.attrs.get(k) != b.attrs.get(k)}
            if [v.type.layout for v in _consts(a)] != [v.type.layout for v in _consts(b)]:
                keys.add("layout")  # weights stored differently (Q4_K_M mixes Q4_K and Q6_K)
            for k in keys:
                if layer not in attrs.setdefault(k, []):
                    attrs[k].append(layer)
    return LayerVariation(attrs, structure)
