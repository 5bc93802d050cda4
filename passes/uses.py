"""Who reads and who makes each value of a graph: what the fusion passes ask
before folding a producer into its one reader."""
from __future__ import annotations

from collections import Counter

from ir.graph import Graph, Node, Value


class Uses:
    """Readers, graph outputs and producers of a graph's values (by id), as
    the graph stands when it is built."""

    def __init__(self, graph: Graph) -> None:
        self.readers = Counter(id(v) for n in graph.nodes for v in n.inputs)
        self.read_by: dict[int, list[Node]] = {}
        for n in graph.nodes:
            for v in {id(v): v for v in n.inputs}.values():
                self.read_by.setdefault(id(v), []).append(n)
        self.outputs = {id(v) for v in graph.outputs}
        self.made_by = {id(n.output): n for n in graph.nodes}

    def only_for(self, v: Value) -> Node | None:
        """The node that makes v, when one node reads v and it is no graph output."""
        if self.readers[id(v)] != 1 or id(v) in self.outputs:
            return None
        return self.made_by.get(id(v))
