"""The graph: values, nodes, weights and state.

A ``Graph`` is SSA-like: each ``Node`` defines one ``Value``; nodes are kept in
a valid topological order. Weights are references into a model file (nothing
is loaded here), state values are the KV cache buffers that persist between
token steps. An op that updates state returns a new value naming the same
buffer, so the order "write the cache, then read it" is a data dependency.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

from .types import TensorType


@dataclass(frozen=True)
class PackedRegion:
    """Bytes stored compressed in the file (a QSF layer's data), or a weight
    stored in another order than the file's (``passes/repack``). The model's
    weight image is the file with each packed region appended, decompressed,
    past its end: image bytes ``[image_offset, image_offset + size)`` are
    ``codec``-decompressed file bytes ``[file_offset, file_offset + stored)``."""

    codec: str
    file_offset: int
    stored: int
    image_offset: int
    size: int
    #: codec "repack": the region is the file's [rows, cols] weight of this
    #: layout, repacked ``repack`` rows at a time (``ir/quant/repack.py``), built at load
    layout: str = ""
    shape: tuple[int, ...] = ()
    repack: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))   # a list, from a manifest


@dataclass(frozen=True)
class WeightRef:
    """Where a weight's bytes are: a file, a byte offset and a stored size.
    The offset is into the file or, with ``packed``, into the weight image
    (the file followed by its decompressed regions)."""

    path: str
    offset: int
    nbytes: int
    packed: PackedRegion | None = None


def packed_regions(refs) -> list[PackedRegion]:
    """The distinct compressed regions behind some weight references, in image order."""
    return sorted({r.packed for r in refs if r is not None and r.packed is not None}, key=lambda p: p.image_offset)


@dataclass(eq=False)
class Value:
    """A typed SSA value. ``kind`` is input, weight, state or node."""

    name: str
    type: TensorType
    kind: str = "node"
    ref: WeightRef | None = None  # weights only
    producer: "Node | None" = field(default=None, repr=False)

    def __repr__(self) -> str:
        return f"Value({self.sigil}{self.name}: {self.type})"

    @property
    def sigil(self) -> str:
        return {"weight": "@", "state": "$"}.get(self.kind, "%")


@dataclass(eq=False)
class Node:
    """One op application. ``attrs`` hold static parameters (eps, heads ...)
    that define what it computes; ``kernel`` how it is run where that does
    not change its numbers (``ir.kernel_choice``)."""

    op: str
    inputs: list[Value]
    output: Value
    attrs: dict[str, Any] = field(default_factory=dict)
    kernel: dict[str, Any] = field(default_factory=dict)


class Graph:
    """A whole token step (decode) or prompt chunk (prefill)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.inputs: list[Value] = []
        self.outputs: list[Value] = []
        self.weights: dict[str, Value] = {}
        self.states: dict[str, Value] = {}
        self.nodes: list[Node] = []
        self.meta: dict[str, Any] = {}
        self._counter = 0

    # --- construction -------------------------------------------------
    def add_input(self, name: str, type: TensorType) -> Value:
        v = Value(name, type, "input")
        self.inputs.append(v)
        return v

    def add_weight(self, name: str, type: TensorType, ref: WeightRef) -> Value:
        if name in self.weights:
            return self.weights[name]
        v = Value(name, type, "weight", ref)
        self.weights[name] = v
        return v

    def add_state(self, name: str, type: TensorType) -> Value:
        v = Value(name, type, "state")
        self.states[name] = v
        return v

    def fresh_name(self) -> str:
        self._counter += 1
        return str(self._counter - 1)

    def add_node(self, op: str, inputs: list[Value], attrs: dict[str, Any] | None = None,
                 name: str | None = None, kernel: dict[str, Any] | None = None) -> Value:
        """Append ``op(inputs)``; its type comes from the op's shape rule."""
        from .ops import get_op

        attrs = dict(attrs or {})
        out_type = get_op(op).infer([v.type for v in inputs], attrs)
        out = Value(name if name is not None else self.fresh_name(), out_type, "node")
        node = Node(op, list(inputs), out, attrs, dict(kernel or {}))
        out.producer = node
        self.nodes.append(node)
        return out

    def set_outputs(self, *values: Value) -> None:
        self.outputs = list(values)

    # --- queries -----------------------------------------------------
    def users(self) -> dict[int, list[Node]]:
        """id(value) -> nodes that read it."""
        out: dict[int, list[Node]] = {}
        for n in self.nodes:
            for v in n.inputs:
                out.setdefault(id(v), []).append(n)
        return out

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)
