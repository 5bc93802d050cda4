"""stream_schedule: which weights are read from disk when, into which buffer.

Streamed weights are grouped into segments (one per layer; one per row block
of a split head), in the order a token step uses them. Segment i always goes
to buffer i % 2 (the count is made even), so a weight's address is a
compile-time offset into one of two buffers. An I/O thread reads segment
s + 1 while segment s computes; the step waits for a segment only when its
read is late and releases it when its last op has run (see
``compiler/codegen/lower.py`` and ``runtime/native.py``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from ir.graph import Graph

ALIGN = 64
_LAYER = re.compile(r"blk\.(\d+)\.")


#: codes of the stream reader's range kinds: a plain read, or a compressed
#: region read into the staging buffer and decompressed into the stream buffer
CODECS = {"none": 0, "lz4": 1, "zstd": 2}

#: where a range's bytes come from: the model file, or the file of its
#: repacked weights (``compiler.repack_cache``: the image bytes from the
#: schedule's ``repack_lo`` on). Streamed weights are repacked as resident
#: ones are, so a budget never changes a token's arithmetic.
FROM_MODEL, FROM_REPACKED = 0, 1


@dataclass
class Segment:
    name: str
    weights: list[str] = field(default_factory=list)
    #: (offset, bytes read, buffer offset, codec code, bytes written to the buffer, source):
    #: the offset is in the model file (FROM_MODEL) or the weight image (FROM_REPACKED)
    ranges: list[tuple[int, int, int, int, int, int]] = field(default_factory=list)
    nbytes: int = 0      # bytes read from the file
    image_offset: int | None = None   # a compressed segment: where its region sits in the weight image


@dataclass
class StreamSchedule:
    segments: list[Segment]
    placement: dict[str, tuple[int, int]]   # weight name -> (segment, offset in its buffer)
    buffer_bytes: int
    #: how a segment comes in: "pread" copies it into buffer s % 2; "mmap"
    #: maps its pages in place (and unmaps segment s - 2's), no copy
    io: str = "pread"
    #: image offset where the repacked weights' file starts (None: no streamed weight is repacked)
    repack_lo: int | None = None

    def segment_of(self, weight: str) -> int | None:
        p = self.placement.get(weight)
        return None if p is None else p[0]

    def read_bytes(self) -> int:
        return sum(s.nbytes for s in self.segments)


def layer_of(name: str) -> int | None:
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def build_schedule(graphs: dict[str, Graph], stream_layers: bool, stream_blocks_of: list[str],
                   io: str = "pread", repack_lo: int | None = None) -> StreamSchedule:
    """Segments for the streamed weights of ``graphs`` (which must all use
    the same weights in the same order: decode, prefill ...). ``repack_lo``:
    the image offset where the repacked weights' file starts (needed when
    a streamed weight is repacked)."""
    weights = {}
    for g in graphs.values():
        for name, v in g.weights.items():
            weights.setdefault(name, v)
    layer_segs: dict[int, list[str]] = {}
    block_segs: list[tuple[str, int, str]] = []
    for name in weights:
        li = layer_of(name)
        if li is not None and stream_layers:
            layer_segs.setdefault(li, []).append(name)
            continue
        base = name.split("[", 1)[0]
        if base in stream_blocks_of and "[" in name:
            r0 = int(name[name.index("[") + 1: name.index(":")])
            block_segs.append((base, r0, name))
    segs = [Segment(f"layer {i}", sorted(layer_segs[i], key=lambda n: weights[n].ref.offset))
            for i in sorted(layer_segs)]
    segs += [Segment(name, [name]) for _, _, name in sorted(block_segs)]
    if len(segs) % 2:
        segs.append(Segment("(padding)"))
    placement: dict[str, tuple[int, int]] = {}
    if io not in ("pread", "mmap"):
        raise ValueError(f"stream io {io!r}: expected pread or mmap")
    streamed_repacked = False
    for i, seg in enumerate(segs):
        packed = {weights[n].ref.packed for n in seg.weights}
        if {p for p in packed if p is not None and p.codec != "repack"}:
            _packed_segment(i, seg, weights, packed, io, placement)
            continue
        top = 0
        for name in seg.weights:
            ref = weights[name].ref
            src = FROM_MODEL if ref.packed is None else FROM_REPACKED
            if src == FROM_REPACKED and repack_lo is None:
                raise ValueError(f"{name} is repacked: the schedule needs where the repacked weights' file starts")
            streamed_repacked |= src == FROM_REPACKED
            placement[name] = (i, top)
            last = seg.ranges[-1] if seg.ranges else None
            if last and last[5] == src and last[0] + last[1] == ref.offset and last[2] + last[1] == top:
                off, n, dst = last[:3]   # adjacent in the source and the buffer: one read
                seg.ranges[-1] = (off, n + ref.nbytes, dst, 0, n + ref.nbytes, src)
            else:
                seg.ranges.append((ref.offset, ref.nbytes, top, 0, ref.nbytes, src))
            top += ref.nbytes
            if top % ALIGN and ref.nbytes:
                pad = ALIGN - top % ALIGN
                top += pad
        seg.nbytes = sum(r[1] for r in seg.ranges)
    size = max((max((r[2] + r[4] for r in s.ranges), default=0) for s in segs), default=0)
    return StreamSchedule(segs, placement, (size + ALIGN - 1) // ALIGN * ALIGN, io,
                          repack_lo if streamed_repacked else None)


def _packed_segment(i: int, seg: Segment, weights: dict, packed: set, io: str,
                    placement: dict[str, tuple[int, int]]) -> None:
    """A segment whose weights lie in one compressed region (a QSF layer):
    one read of the stored bytes, decompressed whole into the buffer, each
    weight at its offset inside the region."""
    if len(packed) != 1 or None in packed:
        raise ValueError(f"{seg.name}: its weights come from several compressed regions (or some from none)")
    p = packed.pop()
    if io == "mmap":
        raise ValueError(f"{seg.name} is compressed: --stream-io mmap maps file pages in place, which a "
                         f"compressed layer cannot use; stream it with pread")
    if p.codec not in CODECS or p.codec == "none":
        raise ValueError(f"{seg.name}: unknown compression {p.codec!r}")
    for name in seg.weights:
        placement[name] = (i, weights[name].ref.offset - p.image_offset)
    seg.ranges = [(p.file_offset, p.stored, 0, CODECS[p.codec], p.size, FROM_MODEL)]
    seg.nbytes = p.stored
    seg.image_offset = p.image_offset


def staging_bytes(sched: StreamSchedule) -> int:
    """Room for the largest compressed read (0 when nothing is compressed)."""
    return max((r[1] for s in sched.segments for r in s.ranges if r[3]), default=0)


def node_segments(graph: Graph, sched: StreamSchedule) -> list[int | None]:
    """For each node, the highest segment it reads (None: none). Checks that
    the step uses segments in order, as the I/O thread reads them."""
    out: list[int | None] = []
    cur = -1
    for node in graph.nodes:
        segs = [sched.segment_of(v.name) for v in node.inputs if v.kind == "weight"]
        segs = [s for s in segs if s is not None]
        if not segs:
            out.append(None)
            continue
        s = max(segs)
        if min(segs) < cur:
            raise ValueError(f"{graph.name}: node %{node.output.name} reads segment {min(segs)} after "
                             f"segment {cur}: the graph does not use streamed weights in order")
        cur = s
        out.append(s)
    return out
