"""The reference interpreter: runs any graph with the ops' numpy references.

It is the oracle. Passes must leave its output unchanged and compiled kernels
are tested against it, so it stays simple: one op at a time, in order.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .graph import Graph, PackedRegion, Value, WeightRef
from .kv_lowbit import GROUP, lowbit
from .quant import repacked_layout
from .ops import WeightData, get_op
from .types import DTYPES, TensorType


class WeightStore:
    """Memory-maps each model file once and hands out weights' raw bytes.
    Weights in a compressed region (``ref.packed``) come from ``unpack``,
    which returns the region's decompressed bytes (kept once read); a
    repacked weight's region is built here from the file's bytes."""

    def __init__(self, unpack: Callable[[str, PackedRegion], np.ndarray] | None = None) -> None:
        self._maps: dict[str, np.memmap] = {}
        self._unpack = unpack
        self._regions: dict[tuple[str, PackedRegion], np.ndarray] = {}

    def raw(self, ref: WeightRef) -> np.ndarray:
        if ref.packed is not None:
            return self._packed(ref)
        m = self._maps.get(ref.path)
        if m is None:
            m = np.memmap(ref.path, dtype=np.uint8, mode="r")
            self._maps[ref.path] = m
        if ref.offset < 0 or ref.offset + ref.nbytes > m.shape[0]:
            raise ValueError(f"{ref.path}: weight bytes {ref.offset}..{ref.offset + ref.nbytes} "
                             f"outside the file ({m.shape[0]} bytes)")
        return m[ref.offset: ref.offset + ref.nbytes]

    def _packed(self, ref: WeightRef) -> np.ndarray:
        p = ref.packed
        key = (ref.path, p)
        if key not in self._regions and p.codec == "repack":   # the file's bytes, repacked (passes/repack)
            src = self.raw(WeightRef(ref.path, p.file_offset, p.stored))
            self._regions[key] = repacked_layout(p.layout, p.repack).repack(src, *p.shape)
        if key not in self._regions:
            if self._unpack is None:
                raise ValueError(f"{ref.path}: weights in a {p.codec}-compressed region need a decompressor")
            self._regions[key] = self._unpack(ref.path, p)
        lo = ref.offset - p.image_offset
        if lo < 0 or lo + ref.nbytes > p.size:
            raise ValueError(f"{ref.path}: weight bytes {ref.offset}..{ref.offset + ref.nbytes} lie outside "
                             f"their compressed region")
        return self._regions[key][lo: lo + ref.nbytes]

    def get(self, v: Value) -> WeightData:
        assert v.ref is not None
        return WeightData(self.raw(v.ref), v.type)


def new_state(graph: Graph) -> dict[str, np.ndarray]:
    """Zeroed buffers for the graph's state (the KV cache)."""
    return {name: state_array(v.type) for name, v in graph.states.items()}


def state_array(t: TensorType) -> np.ndarray:
    """A zeroed state buffer of type ``t``: an array of its dtype, or for a
    quant layout (a q8 KV cache) its stored bytes, uint8 [rows, bytes per row]."""
    shape = tuple(int(d) for d in t.shape)
    lb = lowbit(t.layout)
    if lb is not None:  # a low-bit KV cache: one record per group of 32 (ir.kv_lowbit)
        return np.zeros((shape[0], shape[1] // GROUP), lb.dtype)
    if t.layout is not None:
        return np.zeros((shape[0], t.nbytes() // shape[0]), np.uint8)
    return np.zeros(shape, DTYPES[t.dtype])


def bind_symbols(graph: Graph, feeds: dict[str, np.ndarray]) -> dict[str, int]:
    """Values of symbolic dims (``T``) from the shapes of the fed inputs."""
    syms: dict[str, int] = {}
    for v in graph.inputs:
        arr = np.asarray(feeds[v.name])
        if arr.ndim != v.type.rank:
            raise ValueError(f"input {v.name}: expected rank {v.type.rank}, got shape {arr.shape}")
        for d, n in zip(v.type.shape, arr.shape):
            if isinstance(d, str):
                if syms.setdefault(d, n) != n:
                    raise ValueError(f"symbol {d} bound to {syms[d]} and {n}")
            elif d != n:
                raise ValueError(f"input {v.name}: expected {v.type}, got shape {arr.shape}")
    return syms


def run(graph: Graph, feeds: dict[str, Any], state: dict[str, np.ndarray],
        weights: WeightStore | None = None, keep: bool = False) -> dict[str, np.ndarray]:
    """Execute ``graph``. ``state`` buffers are updated in place. Returns the
    outputs by name (every value by name when ``keep``, for debugging)."""
    weights = weights or WeightStore()
    feeds = {k: np.asarray(v, DTYPES[_input_type(graph, k).dtype]) for k, v in feeds.items()}
    bind_symbols(graph, feeds)
    env: dict[int, Any] = {}
    for v in graph.inputs:
        env[id(v)] = feeds[v.name]
    for name, v in graph.states.items():
        env[id(v)] = state[name]
    for v in graph.weights.values():
        env[id(v)] = weights.get(v)
    names: dict[str, np.ndarray] = {}
    for node in graph.nodes:
        op = get_op(node.op)
        args = [env[id(v)] for v in node.inputs]
        if node.kernel.get("decode_rows") and node.inputs[0].type.rank > 1:
            out = _row_by_row(node, op, args)
        else:
            out = op.ref(*args, **node.attrs)
        env[id(node.output)] = out
        if keep:
            names[node.output.name] = out
    result = {v.name: env[id(v)] for v in graph.outputs}
    if keep:
        names.update(result)
        return names
    return result


def _row_by_row(node, op, args: list[Any]) -> np.ndarray:
    """A ``decode_rows`` node (``ir.kernel_choice``) as its kernel runs it:
    each row on its own, as a decode step computes it, so no row's numbers
    depend on how many came with it. The operands with the rows' axis (x,
    a residual, an accumulator) are cut to the row."""
    rows = node.inputs[0].type.shape[0]
    cut = [v.type.rank > 1 and v.type.shape[0] == rows for v in node.inputs]
    n = np.shape(args[0])[0]
    return np.stack([op.ref(*(a[t] if c else a for a, c in zip(args, cut)), **node.attrs) for t in range(n)])


def _input_type(graph: Graph, name: str) -> TensorType:
    for v in graph.inputs:
        if v.name == name:
            return v.type
    raise KeyError(f"graph {graph.name} has no input {name!r}")
