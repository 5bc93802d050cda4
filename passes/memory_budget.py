"""budget: fit a model into ``--mem-budget`` bytes of resident memory.

The planner decides, from sizes alone, which weights stay resident
(memory-mapped: every page is touched each token, so they count in full),
which stream from disk through two buffers (``passes/stream_schedule``), and
the KV cache's dtype and length. Preferences, in order: keep weights
resident (fastest), then stream the layers, then the output head too (split
into row blocks by ``passes/split_rows``), all with the default f16 KV cache
at the requested context; then a shorter context; only then a q8 KV cache.
Streaming and a shorter context leave every output as it was without a
budget (within the context); a less precise KV cache does not. The
runtime's own floor (Python, numpy, the tokenizer, the native code) is part
of the sum: the budget is for the whole process's peak RSS.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from ir.kv_lowbit import RECENT
from ir.types import KEY_OFFSET_KV_TYPES

MiB = 1 << 20
PAGE = 4096
#: the runtime's resident floor before any model data: Python, numpy, lmc's
#: modules and the loaded native code (measured: VmHWM of a warm `lmc run
#: --mem-budget` of stories260K, whose weights are 1 MB, 37.4 MB once lmc
#: stopped loading OpenSSL for its hashes and returns freed heap after loading)
RUNTIME_BASE = 36 * MiB
#: resident bytes per vocabulary entry of a loaded tokenizer (measured on
#: Gemma's 262144 entries: RSS 21.0 MB more after ``runtime.load_tokenizer``
#: of a QSF file, 82 bytes each; 56, measured earlier, no longer held: runs of
#: Gemma Q2 under --mem-budget 64M planned 62.7 MiB and peaked at 66-68)
TOKENIZER_PER_TOKEN = 84
#: a decompressor's own memory on the I/O thread: libzstd's pages and its
#: decompression context (measured: 0.9 MB beyond the staging buffer)
DECOMPRESSOR_BYTES = 1 * MiB
#: the shortest context the planner will choose on its own
MIN_CTX = 256
KV_BYTES = {"f32": 4.0, "f16": 2.0, "q8": 34 / 32, "q4": 20 / 32, "q4-plain": 20 / 32, "q2": 12 / 32,
            "q2-plain": 12 / 32}


class BudgetError(ValueError):
    """No plan fits; the message says what the smallest workable budget is."""


def parse_size(text: str, flag: str = "--mem-budget") -> int:
    """'200M', '1.5G', '512k', '1048576' -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(i?[bB])?\s*", str(text))
    if not m:
        raise BudgetError(f"{flag} {text!r}: not a size (examples: 200M, 1.5G, 512K)")
    n = float(m.group(1)) * (1 << (10 * " KMGT".index((m.group(2) or " ").upper())))
    if n < 1:
        raise BudgetError(f"{flag} {text!r}: must be positive")
    return int(n)


def fmt_size(n: float) -> str:
    return f"{n / MiB:.1f} MiB" if n < 1 << 30 else f"{n / (1 << 30):.2f} GiB"


@dataclass(frozen=True)
class WeightInfo:
    name: str
    nbytes: int
    layer: int | None         # blk.N.* weights; None for the rest
    lookup_only: bool = False  # read by embedding lookups only (a row per token)
    looked_up: bool = False    # read by an embedding lookup (a tied head is both)
    splittable: bool = True    # rows are byte ranges (split_rows can cut it)
    matmul: bool = False       # read by a matrix product (the head, when it has no layer)


@dataclass
class ModelSizes:
    """What the planner needs to know about a compiled model."""

    weights: list[WeightInfo]
    n_layers: int
    kv_dim: int
    head_dim: int
    vocab_size: int
    max_ctx: int
    arena_bytes: int           # largest arena of the graphs a run uses
    arena_lower_bound: int
    scratch_bytes_per_ctx: int  # per thread and context position (attention scores)
    scratch_fixed: int          # per thread, the rest
    code_bytes: int = 2 * MiB
    #: the largest compressed layer's stored bytes (0: none): streamed, it is
    #: read into a staging buffer and decompressed into a stream buffer
    packed_layer_bytes: int = 0
    #: per layer, the positions its ring keeps (a sliding-window layer: window
    #: + chunk), 0 for a layer that keeps the whole context; empty: no rings
    ring_rows: tuple[int, ...] = ()
    #: a low-bit cache's exact rows (``ir.ops.attention``'s ``recent``): the positions of
    #: each layer's f16 ring of them (0: the whole context), None: the graphs keep none
    exact_ring: int | None = None

    def kv_positions(self, ctx: int) -> int:
        """Cache rows (positions) of all layers together at a context of ``ctx``."""
        if not self.ring_rows:
            return self.n_layers * ctx
        return sum(min(r, ctx) if r else ctx for r in self.ring_rows)

    def exact_bytes(self, ctx: int, kv_type: str) -> int:
        """Bytes of the exact rows' K and V caches beside a low-bit ``kv_type`` (f16, and
        the sink row), 0 for other types."""
        if self.exact_ring is None or kv_type not in KEY_OFFSET_KV_TYPES:
            return 0
        return int(2 * self.n_layers * (min(self.exact_ring or ctx, ctx) + 1) * self.kv_dim * KV_BYTES["f16"])


@dataclass
class MemoryPlan:
    budget: int | None
    stream_layers: bool
    stream_head: list[str]             # weights streamed in row blocks
    head_rows: int | None              # rows per block for those
    buffer_bytes: int                  # one stream buffer (two are allocated)
    kv_type: str
    ctx: int
    categories: dict[str, int] = field(default_factory=dict)
    arena_lower_bound: int = 0
    notes: list[str] = field(default_factory=list)
    #: as ``ModelSizes.ring_rows``: the layers whose cache is a ring, and its positions
    ring_rows: tuple[int, ...] = ()
    #: as ``ModelSizes.exact_ring``, where the KV type has exact rows
    exact_ring: int | None = None

    @property
    def total(self) -> int:
        return sum(self.categories.values())

    @property
    def streaming(self) -> bool:
        return self.stream_layers or bool(self.stream_head)

    def describe(self) -> str:
        what = []
        if self.stream_layers:
            what.append("streams the layers")
        if self.stream_head:
            what.append(f"streams {', '.join(self.stream_head)} in blocks of {self.head_rows} rows")
        if not what:
            what.append("keeps every weight resident")
        rings = [r for r in self.ring_rows if r and r < self.ctx]
        ring = f" ({len(rings)} sliding-window layers keep a ring of {max(rings)})" if rings else ""
        if self.exact_ring is not None:
            ring += (f"; each layer's last {RECENT} positions and position 0 also in f16 (a ring of "
                     f"{min(self.exact_ring or self.ctx, self.ctx)})")
        return f"{' and '.join(what)}, KV cache {self.kv_type} x {self.ctx} positions{ring}"


def runtime_floor(vocab_size: int, code_bytes: int) -> int:
    return RUNTIME_BASE + TOKENIZER_PER_TOKEN * vocab_size + code_bytes


def _head_weights(s: ModelSizes) -> list[WeightInfo]:
    return [w for w in s.weights if w.layer is None and w.matmul]


def _evaluate(s: ModelSizes, threads: int, stream_layers: bool, stream_head: bool, kv_type: str,
              ctx: int) -> MemoryPlan:
    layer_bytes: dict[int, int] = {}
    for w in s.weights:
        if w.layer is not None:
            layer_bytes[w.layer] = layer_bytes.get(w.layer, 0) + w.nbytes + 64
    heads = _head_weights(s) if stream_head else []
    seg = max(layer_bytes.values(), default=0) if stream_layers else 0
    head_rows = None
    if heads:
        # head blocks about the size of a layer (at least 1 MiB), so the two
        # buffers serve both
        block = max(seg, MiB)
        big = max(heads, key=lambda w: w.nbytes)
        rows_total = s.vocab_size
        row_bytes = max(1, big.nbytes // max(1, rows_total))
        head_rows = min(rows_total, max(64, block // row_bytes // 64 * 64))
        seg = max(seg, head_rows * row_bytes + 64)
    streamed = {w.name for w in heads} | ({w.name for w in s.weights if w.layer is not None}
                                           if stream_layers else set())
    resident = 0
    for w in s.weights:
        if not w.lookup_only and w.name not in streamed:
            resident += w.nbytes                      # every page read each token
        elif w.lookup_only or w.looked_up:
            resident += min(w.nbytes, ctx * PAGE)     # embedding rows: a page per token at most
    kv = int(2 * s.kv_positions(ctx) * s.kv_dim * KV_BYTES[kv_type]) + s.exact_bytes(ctx, kv_type)
    scratch = threads * (s.scratch_fixed + s.scratch_bytes_per_ctx * ctx)
    cats = {
        "resident weights": resident,
        "stream buffers": 2 * seg,
        "kv cache": kv,
        "activation arena": s.arena_bytes,
        "scratch": scratch,
        "runtime": runtime_floor(s.vocab_size, s.code_bytes),
    }
    if stream_layers and s.packed_layer_bytes:   # compressed layers are read here, then decompressed
        cats["stream staging"] = s.packed_layer_bytes + DECOMPRESSOR_BYTES
    return MemoryPlan(None, stream_layers, [w.name for w in heads], head_rows, seg, kv_type, ctx, cats,
                      s.arena_lower_bound, ring_rows=tuple(s.ring_rows),
                      exact_ring=s.exact_ring if kv_type in KEY_OFFSET_KV_TYPES else None)


def kv_types(head_dim: int) -> list[str]:
    return ["f16"] + (["q8"] if head_dim % 32 == 0 else [])


def plan_memory(s: ModelSizes, budget: int | None, threads: int, ctx: int | None = None,
                kv_type: str | None = None, stream: str | None = None) -> MemoryPlan:
    """The most resident plan whose total fits ``budget`` (None: no budget).
    ``ctx``/``kv_type`` given by the user are kept. ``stream`` ("layers" or
    "all") streams at least that much even when it would fit resident."""
    want_ctx = ctx or s.max_ctx
    kvs = [kv_type] if kv_type else kv_types(s.head_dim)
    if stream not in (None, "layers", "all"):
        raise BudgetError(f"--stream {stream!r}: expected layers or all")
    if budget is None:
        p = _evaluate(s, threads, stream is not None, stream == "all", kvs[0], want_ctx)
        p.notes.append(f"streaming forced: {stream}" if stream else "no budget: everything resident")
        return p
    floor = runtime_floor(s.vocab_size, s.code_bytes)
    if budget < floor:
        raise BudgetError(f"--mem-budget {fmt_size(budget)} is below the runtime's own floor of "
                          f"{fmt_size(floor)} (Python, numpy, native code, a {s.vocab_size}-token tokenizer)")
    can_split = all(w.splittable for w in _head_weights(s))
    shapes = [(False, False), (True, False)] + ([(True, True)] if can_split else [])
    if stream:
        shapes = shapes[1:] if stream == "layers" else shapes[2:]
        if not shapes:
            raise BudgetError("--stream all: the output head's layout cannot be split into row blocks")
    ctxs = [want_ctx] if ctx else _shorter(want_ctx)
    # exact plans first (weights resident or streamed, f16 KV: the same
    # numbers as without a budget), the full context before a shorter one;
    # only then a KV cache of less precision
    exact = kvs[:1]
    order = [(shp, exact[0], want_ctx) for shp in shapes]
    order += [(shapes[-1], exact[0], c) for c in ctxs[1:]]
    order += [(shapes[-1], kv, c) for kv in kvs[1:] for c in ctxs]
    tried: list[MemoryPlan] = []
    for (layers, head), kv, c in order:
        p = _evaluate(s, threads, layers, head, kv, c)
        tried.append(p)
        if p.total <= budget:
            p.budget = budget
            if c < want_ctx:
                p.notes.append(f"context shortened to {c} positions to fit the budget")
            return p
    best = min(tried, key=lambda p: p.total)
    raise BudgetError(f"--mem-budget {fmt_size(budget)} cannot hold this model: the smallest workable "
                      f"budget is {fmt_size(best.total)}, which {best.describe()}")


def _shorter(ctx: int) -> list[int]:
    out = [ctx]
    while out[-1] // 2 >= MIN_CTX:
        out.append(out[-1] // 2)
    if out[-1] > MIN_CTX and ctx > MIN_CTX:
        out.append(MIN_CTX)
    return out
