"""repack: the integer path's weights move to their repacked form
(``ir/quant/repack.py``), W rows interleaved in VNNI order, which the
runtime builds once at load; every row count of every graph then runs one
kernel (``matmul/repacked``) with one arithmetic.

Why a pass and not a kernel detail: the weight's bytes change, so its type
(layout) and its place (a region of the weight image past the file, like a
QSF layer's decompressed bytes: ``ir.graph.PackedRegion`` with codec
``repack``) change, and the plan, the artifact's manifest, ``lmc ir`` and the
interpreter all see it. The interpreter reads a repacked weight by repacking
the file's bytes (``ir.interp.WeightStore``) and its reference unrepacks
them, so the pass leaves the numbers where they were.

The tile width comes from ``graph.meta["repack_width"]`` (the compiler sets
it from the host: 16 with AVX-512 VNNI, 8 with 256-bit VNNI); without it the
pass does nothing. A weight is repacked where an integer-path ``qmatmul``
reads it (``act``, set by ``int_dot``) and its shape fills whole tiles;
other readers (a tied embedding's lookup) keep the file's bytes. Streamed
weights (a memory budget) are repacked too: the stream reader reads them
from the file of repacked bytes (``compiler.repack_cache``), so a budget
changes where a weight lives, never the numbers a token gets.

Image offsets must be the same in every graph of a model (the decode step
and the prefill share one image), so they follow from the graph alone: the
weights repacked, in file order, from the first 2 MiB boundary past the
file (and past any region already there).
"""
from __future__ import annotations

import os

from ir.graph import Graph, PackedRegion, Value, WeightRef
from ir.quant import repacked_layout
from ir.quant.repack import can_repack
from ir.types import TensorType

from .dce import dce
from .registry import register_pass

#: the image's repacked regions start on a huge page boundary (transparent
#: huge pages for the weights every step reads), each on a cache line
IMAGE_ALIGN = 2 << 20
REGION_ALIGN = 64


def _up(n: int, a: int) -> int:
    return -(-n // a) * a


def _shape(v: Value) -> tuple[int, int] | None:
    t = v.type
    if t.rank != 2 or not all(isinstance(d, int) for d in t.shape):
        return None
    return int(t.shape[0]), int(t.shape[1])


def image_regions(graph: Graph, width: int) -> dict[str, PackedRegion]:
    """weight name -> where its repacked form lies in the weight image, for
    every weight an integer-path qmatmul of ``graph`` reads that has one at
    ``width``. The graphs of one model (decode, prefill, batch, verify) read
    the same weights with the same ops, so they agree on the offsets
    (``compiler.native`` checks)."""
    cands = {}
    for node in graph.nodes:
        v = node.inputs[1] if node.op == "qmatmul" and node.attrs.get("act") else None
        s = _shape(v) if v is not None and v.kind == "weight" else None
        if s and v.ref is not None and v.ref.packed is None and can_repack(v.type.layout, *s, width):
            cands[v.name] = (v.ref.offset, v.name, v, s)
    cands = list(cands.values())
    if not cands:
        return {}
    paths = {v.ref.path for _, _, v, _ in cands}
    if len(paths) != 1:
        raise ValueError(f"repack: weights from several files ({', '.join(sorted(paths))})")
    end = os.path.getsize(paths.pop())
    for v in graph.weights.values():
        if v.ref is not None and v.ref.packed is not None:
            end = max(end, v.ref.packed.image_offset + v.ref.packed.size)
    at = _up(end, IMAGE_ALIGN)
    out = {}
    for _, name, v, (rows, cols) in sorted(cands, key=lambda c: (c[0], c[1])):
        size = repacked_layout(v.type.layout, width).nbytes((rows, cols))
        out[name] = PackedRegion("repack", v.ref.offset, v.ref.nbytes, at, size, v.type.layout, (rows, cols), width)
        at = _up(at + size, REGION_ALIGN)
    return out


@register_pass("repack")
def repack(graph: Graph) -> Graph:
    """Integer-path qmatmuls read their weights repacked W rows at a time (one kernel for every row count)."""
    width = graph.meta.get("repack_width")
    if not width:
        return graph
    regions = image_regions(graph, int(width))
    repacked: dict[str, Value] = {}
    for node in graph.nodes:
        if node.op != "qmatmul" or not node.attrs.get("act"):
            continue
        w = node.inputs[1]
        region = regions.get(w.name) if w.kind == "weight" else None
        if region is None:
            continue
        if w.name not in repacked:
            t = TensorType(w.type.shape, w.type.dtype, w.type.layout, region.repack)
            ref = WeightRef(w.ref.path, region.image_offset, region.size, region)
            repacked[w.name] = graph.add_weight(f"{w.name}@{t.stored}", t, ref)
        node.inputs[1] = repacked[w.name]
        # the kernel's numbers do not depend on the row count: one kernel for decode, prompt and batch rows
        node.kernel = {}
    if not repacked:
        return graph
    dce(graph)
    # a weight only its matmuls read keeps its name (its type says it is repacked); one a
    # tied embedding still reads in the file's order keeps it for that, beside name@layout
    names = {id(v): name for name, v in repacked.items() if name not in graph.weights}
    for v in repacked.values():
        v.name = names.get(id(v), v.name)
    graph.weights = {names.get(id(v), k): v for k, v in graph.weights.items()}
    return graph
