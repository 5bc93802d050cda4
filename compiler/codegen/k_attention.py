"""Causal grouped-query attention against the KV cache (``attention_ref``,
``attention_paged_ref``).

Work units are (row t, a run of query heads) pairs, split between threads
in contiguous shares, head-group-major: a prompt chunk's thread then reads
the keys and values of few KV heads (Qwen2.5-0.5B, 2 threads: one each),
which stay in its L2 from row to row; t-major, each thread read every KV
head's rows (1.8 MB at 3,500 positions) for each of its rows, from L3, and
a chunk of 128 rows took 2.2x the time of 128 decode steps' attention.
A unit's heads share one KV head (query head h reads kv head
h // (n_heads / n_kv_heads)), so each key and value row it reads serves all
of them: one read from memory for the group, where a unit per head read the
rows once per head (``heads_per_unit``: 7 of Qwen2.5-0.5B's 14 heads, 2 of
Gemma 3's 4, so a decode step still has a unit per thread). Each head's
arithmetic is the same operations in the same order either way. Row t sits
at position pos+t and sees cache positions [start, pos+t] with
start = max(0, pos+t+1-window) when a window is set, else 0. A sliding-
window layer's cache may be a ring of R rows (attribute ``ring``):
position p at row p % R, the visible run wrapping at most once.

``attention_paged`` is the same kernel with two things swapped (``_Rows``):
row t's position is positions[t], and position p of its sequence is read
from the pool row its block table gives (``paging.PagedRows``) instead of
cache row p. Its rows may be of different sequences and lengths, so threads
take units strided (tid, tid + nthreads, ...) rather than one contiguous
share: long and short rows spread over all threads. ROWS rows that are a
run of one sequence (a prompt chunk: consecutive positions, the same
table) take the scores pass together, as a single sequence's chunk does;
other blocks of ROWS rows (decode rows, two sequences) go row by row
(``_PagedRows.together`` decides at run time).

Per unit, three passes over the visible positions:

1. scores s_j = (k_j . q) * scale into this thread's scratch, B positions at
   a time: B dot products with q held in registers, their horizontal sums
   folded into one <B x float> (``hsum_many``), stored and max-reduced as a
   vector. Leftover positions (n % B) go one by one.
2. p_j = exp(s_j - max) (inline vector exp, ``exp_poly``) in place of the
   scores, and sum += p_j.
3. acc += p_j * v_j, then out = acc / sum; one pass over the values per
   group of head_dim's vectors whose accumulators for all the unit's heads
   fit in registers (``GROUP_ACCS``): Qwen2.5's 7 heads x 4 vectors at once
   spilled on every position. Each value row is still read once: a group
   reads its own part of it. Each accumulator takes the same products in
   the same order as before.

A call of ROWS rows or more on an f32 or f16 contiguous cache without a
window (a prompt chunk, a speculative check) takes pass 1 for ROWS rows at
once (``scores_rows``): each block of 16 keys (8 on 8 lanes) is widened and
transposed once (lanes = keys) for the rows x heads, and every key's score
is the same chain of multiply-adds and the same tree of adds as in the
one-row pass, done as vertical operations on 16 keys instead of
horizontal sums per key; passes 2 and 3 stay per row. The bits are the
decode step's (tests/test_kernels_attention.py::
test_chunk_rows_have_the_decode_steps_bits). Qwen2.5's shape, 128 rows at
3,500 positions, 1 thread: 21.7-22.1 CPU ms per call before, 16.8-17.1
after; one decode row at 3,500 positions 179-193 us before, 165-170 after
(the softmax's exponentials 16 lanes at a time).

With the kernel attribute ``tiled`` = 1 (off by default: see
``k_attention_tiled.DEFAULT``), a call of ``k_attention_tiled.MIN_ROWS``
rows or more (a prompt chunk) on a host with AMX bf16 takes the tiled
kernel instead (16 rows a tile, every operand in two bf16 halves, f32
sums), unless the cache is not f16 (f32 keeps this kernel's f32
arithmetic, q8 and the low-bit types their packed reads), a ring or a
window is set or head_dim is not a multiple of 32; the same compiled
function branches on the rows at run time.

Vectors over head_dim have the largest power-of-two width <= the target's
that divides head_dim, so any head_dim works without a scalar tail (8 ->
<8 x float>, 24 -> 3 x <8 x float>, 6 -> 3 x <2 x float>).

The cache holds f32, f16, q8, q4 or q2 (``--kv-type``). f16 rows are widened as
they are loaded (fpext). A q8 row is Q8_0 blocks (float16 scale d, 32 int8 q;
head_dim is a multiple of 32, so a head is whole blocks): k_j . q is summed
per block over the integers (sitofp) and scaled by d once per block, and the
weighted sum adds (p_j * d) * q per block. Equal to the reference's d * q
values up to float rounding order.

A q4 / q2 cache (``ir.kv_lowbit``) is groups of 32 codes with an f16 step d
and minimum m, value = code * d + m: k_j . q is summed per group as
d * (codes . q) + m * (sum of q over the group), the last a vector of q's
partial sums per group made once per unit; the weighted sum adds
(p_j * d) * code + p_j * m. A rotated cache (q4, q2: each head stored times
the Walsh-Hadamard H / sqrt(hd)) has the unit's queries rotated the same
way once, in registers, as they are loaded (scores unchanged: H is
orthogonal); the output, H times the true weighted sum, is rotated back
(H is its own inverse) after the last group is stored.

Beside a low-bit cache a call may have exact rows (two more inputs, f16:
``ir.ops.attention``'s ``recent``): a row's visible positions then fall in
three runs, position 0 (the sink row) when visible, the low-bit rows up to
its last ``recent`` positions, and those from the exact ring. Pass 1 scores
each run in turn (the low-bit one with the rotated queries, the exact ones
with the queries as they came); pass 3 sums the low-bit values as above,
rotates them back, then adds the exact rows' weighted sum.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import llvmlite.ir as ir

from ir.kv_lowbit import GROUP, lowbit

from . import k_attention_tiled
from . import kv_lowbit as lb_emit
from .emit import F32, KernelBuilder, exp_poly, fconst, fmuladd, hsum_many, i64, pow2_divisor
from .kernels import KernelSig, kernel
from .paging import PagedRows
from .simd import shuffle

#: vectors of key rows a block of the scores pass holds (the kernel attribute ``unroll``
#: replaces the block it gives: ``lmc kernel`` tries others). Positions per block: the largest
#: power of two, at most 8, whose rows take at most this many vectors (``block_positions``).
#: Blocks of 8 spilled the widened keys of AVX-512's 4-vector rows (Qwen2.5's and SmolLM2's
#: head_dim 64). Zen 4, 2 threads, 3,500 positions, kernel lab medians (µs) of alternated runs:
#: Qwen2.5 (7 heads a unit) 8 positions 93.7-96.0, 4 86.3-88.6, 2 99.9-113, 16 104-117;
#: SmolLM2 (3 heads) 8: 103-105, 4: 83-85, 2: 95-99; Gemma 3 (head_dim 256, 16 vectors a row)
#: 8: 133-160, 2: 128-144, 1: 110-112; head_dim 128, 4 heads a unit, 2,000 positions 8:
#: 303-308, 4: 299-341, 2: 239-279. AVX2 code (x86-64-v3, 8 lanes) on the same CPU, Qwen2.5's
#: shape: 8 positions 160-173, 4: 166-176, 2: 160-163.
KEY_VECTORS = 16
BLOCK_MAX = 8


def block_positions(nvec: int) -> int:
    """Positions per block of the scores pass for rows of ``nvec`` vectors (KEY_VECTORS)."""
    B = 1
    while B * 2 <= BLOCK_MAX and B * 2 * nvec <= KEY_VECTORS:
        B *= 2
    return B


HALF = ir.HalfType()
#: a q8 cache block: 32 values, float16 scale + 32 int8
QK, Q8_BYTES = 32, 34


def cache_kind(t) -> str:
    """How a KV cache of type ``t`` is stored: "f32", "f16", "q8" or "lowbit"
    (q4 / q2, rotated or not: ``ir.kv_lowbit.lowbit(t.layout)`` says)."""
    if t.layout is None and t.dtype in ("f32", "f16"):
        return t.dtype
    if t.layout == "Q8_0":
        return "q8"
    if lowbit(t.layout) is not None:
        return "lowbit"
    if t.layout == "F32" and t.dtype == "f32":
        return "f32"
    raise NotImplementedError(f"attention: native kernel reads f32, f16 or Q8_0 caches, got {t}")


def heads_per_unit(sig: KernelSig) -> int:
    """Query heads a work unit takes together (they share a KV head, so each
    key and value row is read once for all of them, not once per head):
    the largest divisor of the group size that leaves a decode step at
    least two units (two threads' work), at most 8 (``heads`` overrides)."""
    a = sig.attr
    H, KVH = int(a["n_heads"]), int(a["n_kv_heads"])
    group = H // KVH
    if "heads" in a:
        return int(a["heads"])
    return max(d for d in range(1, min(group, 8) + 1) if group % d == 0 and (H // d >= 2 or d == 1))


#: how many positions ahead of the scores the keys are prefetched (into L2). A
#: Qwen2.5-0.5B step of 8 decode rows at position 120 (alternated, 3 runs each): attention
#: 1.72-1.83 ms with one block (8) ahead into L1, 1.50-1.56 with 32 into L2, 1.65-1.78 with 64.
#: A decode step after 3,500 positions on Zen 4 (lmc profile, attention ms of the step,
#: alternated): 32 ahead 3.85, 4.03, 3.93; 64: 3.73, 4.46, 3.84; 128: 4.72, 4.36, 3.76
PREFETCH_AHEAD = 32
#: lanes of the softmax's exponentials (``exp_poly`` is lane by lane: any width gives the same bits)
EXP_LANES = 16
#: accumulators (vectors) the weighted sum keeps in registers at once
GROUP_ACCS = 16


def _vectors_per_group(heads: int, nvec: int, unit: int) -> int:
    """Vectors of head_dim the weighted sum does per pass over the values:
    the most (a multiple of ``unit``, dividing ``nvec``) whose accumulators
    for all the unit's heads fit GROUP_ACCS registers, at least ``unit``."""
    best = unit
    for g in range(unit, nvec + 1, unit):
        if nvec % g == 0 and g * heads <= GROUP_ACCS:
            best = g
    return best


#: query rows a unit of a chunk takes together (``scores_rows``): each key block is widened and
#: transposed once for ROWS rows x the unit's heads
ROWS = 4
#: the most head-rows whose scores take each transposed key vector from one load (their trees side
#: by side). Qwen2.5's shape, 128 rows at 3,500 positions, 1 thread, CPU ms per call (the lower of
#: two runs' minimums): 4 rows x groups of 4 head-rows 17.6, of 7 16.5, of 8 16.8, of 14 18.2, of 28
#: 20.5; 8 rows x 7 18.0
SCORE_GROUP = 8
#: head_dim vectors up to which the rows pass's score chains are unrolled (Qwen2.5's and
#: SmolLM2's 4 at 16 lanes); longer chains (Gemma 3's 16) are loops
UNROLLED_CHAIN = 4
#: keys past the cache length a row's scores may take (a 16-key block of the rows' pass runs past the
#: last visible key; those scores are never read)
SCORE_PAD = 64


def rows_together(sig: KernelSig) -> bool:
    """Whether a chunk's rows take the scores pass ROWS rows at a time: an f32 or
    f16 contiguous cache without a window (each of the rows sees keys [0, its
    end)) and head_dim a multiple of 8 (a key block is 8 or 16 keys, as wide
    as the pieces of head_dim). Quantized caches, windows and rings keep
    the one-row pass; so does a call of fewer than ROWS rows. Both give the
    same bits (see ``scores_rows`` in ``_emit_attention``)."""
    a = sig.attr
    return (cache_kind(sig.in_types[1]) in ("f32", "f16") and not a.get("ring")
            and not int(a.get("window", 0) or 0) and int(a["head_dim"]) % 8 == 0)


def _positions(sig: KernelSig) -> int:
    """Scores one head of one row keeps (scratch floats): the cache length and a pad
    (paged: a block table's worth of positions)."""
    if sig.op == "attention_paged":
        return int(sig.in_types[4].shape[1]) * int(sig.attr["block_size"]) + SCORE_PAD
    return int(sig.in_types[1].shape[0]) + SCORE_PAD


def scratch_floats(sig: KernelSig) -> int:
    """Per-thread scratch (float32 elements): attention keeps one score per
    visible position and head of its unit, at most the cache length
    (paged: a block table's worth of positions), for ROWS rows when they are
    taken together, and a transposed key block; the other ops here need none."""
    if sig.op == "attention":
        rows = _positions(sig) * heads_per_unit(sig)
        if rows_together(sig):
            rows = rows * ROWS + int(sig.attr["head_dim"]) * 16
        if (k_attention_tiled.supported(sig, cache_kind(sig.in_types[1]))
                and int(sig.attr.get("tiled", k_attention_tiled.DEFAULT))):
            rows = max(rows, -(-k_attention_tiled.scratch_bytes(sig) // 4))
        return rows
    if sig.op == "attention_paged":
        rows = _positions(sig) * heads_per_unit(sig)
        return rows * ROWS + int(sig.attr["head_dim"]) * 16 if rows_together(sig) else rows
    return 0


class _Rows:
    """Where query row t sits and where its visible cache rows are: row t at
    position pos + t, cache position p at cache row p."""

    strided = False   # threads take one contiguous share of the units

    def __init__(self, kb: KernelBuilder, ring: int = 0) -> None:
        self.kb = kb
        self.ring = ring

    def end(self, t: ir.Value) -> ir.Value:
        """One past row t's position."""
        return self.kb.b.add(self.kb.b.add(self.kb.pos, t), i64(1))

    def together(self, t0: ir.Value, R: int, nrows: ir.Value) -> ir.Value | None:
        """Whether rows t0 .. t0 + R - 1 may take the scores pass together (an
        i1), or None: always (one sequence's rows, consecutive positions)."""
        return None

    def rows(self, cache: ir.Value, t: ir.Value, start: ir.Value, head: ir.Value,
             row_step: int) -> Callable[[ir.Value], ir.Value]:
        """j -> pointer to row t's visible position start + j in ``cache``,
        at element (or byte) offset ``head`` within the row."""
        b = self.kb.b
        if self.ring:   # row (start + j) % R: start's row once, then one compare a row
            R = i64(self.ring)
            r0 = b.urem(start, R)
            base = self.kb.gep(cache, head)

            def at(j: ir.Value) -> ir.Value:
                r = b.add(r0, j)
                r = b.select(b.icmp_unsigned(">=", r, R), b.sub(r, R), r)
                return self.kb.gep(base, b.mul(r, i64(row_step)))
            return at
        base = self.kb.gep(cache, b.add(b.mul(start, i64(row_step)), head))
        return lambda j: self.kb.gep(base, b.mul(j, i64(row_step)))


class _PagedRows(_Rows):
    """Row t at positions[t]; its sequence's positions in a block pool."""

    strided = True

    def __init__(self, kb: KernelBuilder, sig: KernelSig) -> None:
        super().__init__(kb)
        self.paged = PagedRows(kb, kb.in_raw[3], kb.in_raw[4], int(sig.attr["block_size"]),
                               int(sig.in_types[4].shape[1]))

    def end(self, t: ir.Value) -> ir.Value:
        return self.kb.b.add(self.paged.position(t), i64(1))

    def together(self, t0: ir.Value, R: int, nrows: ir.Value) -> ir.Value:
        """Rows t0 .. t0 + R - 1 all in the step, at consecutive positions,
        with the same table entries up to the last one's block: then each
        reads the keys [0, its end) of the same pool rows, as a prompt
        chunk's rows do (a run of one sequence; a decode row beside them,
        or another sequence sharing only a prefix block, is not)."""
        kb, b = self.kb, self.kb.b
        lastrow = b.sub(nrows, i64(1))
        rows = [kb.imin(b.add(t0, i64(k)), lastrow) for k in range(R)]
        p0 = self.paged.position(rows[0])
        ok = b.icmp_signed("<=", b.add(t0, i64(R - 1)), lastrow)
        for k in range(1, R):
            ok = b.and_(ok, b.icmp_signed("==", self.paged.position(rows[k]), b.add(p0, i64(k))))
        nblk = b.select(ok, b.add(b.udiv(b.add(p0, i64(R - 1)), i64(self.paged.bs)), i64(1)), i64(0))
        tabs = [self.paged.table(r) for r in rows]
        with kb.loop_carry(0, nblk, [ok], name="same") as (j, (acc,), setv):
            e0 = b.load(kb.gep(tabs[0], j), align=4)
            for tb in tabs[1:]:
                acc = b.and_(acc, b.icmp_signed("==", b.load(kb.gep(tb, j), align=4), e0))
            setv([acc])
        return kb.last_carry[0]

    def rows(self, cache: ir.Value, t: ir.Value, start: ir.Value, head: ir.Value,
             row_step: int) -> Callable[[ir.Value], ir.Value]:
        b = self.kb.b
        base = self.kb.gep(cache, head)
        table = self.paged.table(t)
        return lambda j: self.kb.gep(base, b.mul(self.paged.pool_row(table, b.add(start, j)), i64(row_step)))


@kernel("attention")
def emit_attention(kb: KernelBuilder, sig: KernelSig) -> None:
    rows = _Rows(kb, int(sig.attr.get("ring") or 0))
    kind = cache_kind(sig.in_types[1])
    b = kb.b
    T = kb.rows_of(sig.in_types[0].shape)
    fixed = kb.static_rows(sig.in_types[0].shape)   # a decode step's kernel: 1 row, no chunk paths

    def float_kernel() -> None:
        """ROWS rows a unit for a chunk, one for a decode step: the same bits per row."""
        T = kb.rows_of(sig.in_types[0].shape)   # (the rows of ``_row_range`` where one is open)
        if not (rows_together(sig) and pow2_divisor(int(sig.attr["head_dim"]), kb.vw) >= 8) or \
                (fixed is not None and fixed < ROWS):
            _emit_attention(kb, sig, rows)
            return
        with b.if_else(b.icmp_signed(">=", T, i64(ROWS))) as (together, alone):
            with together:
                _emit_attention(kb, sig, rows, ROWS)
            with alone:
                _emit_attention(kb, sig, rows)
    if not k_attention_tiled.usable(kb, sig, kind) or (fixed is not None and fixed < k_attention_tiled.MIN_ROWS):
        float_kernel()
        return
    start = int(sig.attr.get("tiled_from", 0) or 0)
    if start <= 0:
        # a prompt chunk (T >= MIN_ROWS) on AMX bf16 tiles, fewer rows (decode, a check) per row
        with b.if_else(b.icmp_signed(">=", T, i64(k_attention_tiled.MIN_ROWS))) as (tiled, per_row):
            with tiled:
                k_attention_tiled.emit_tiled(kb, sig, kind)
            with per_row:
                float_kernel()
        return
    # a model's prompt chunk: its rows before position ``start`` per row (a decode step's
    # bits), the rest on the tiles however few they are (a row's bits then depend on its
    # position alone, not on how the prompt was cut into chunks)
    exact = kb.imin(kb.imax(b.sub(i64(start), kb.pos), i64(0)), T)
    row = int(sig.in_types[0].shape[-1]) * 4     # bytes of a query (and an output) row
    with b.if_then(b.icmp_signed(">", exact, i64(0))), _row_range(kb, i64(0), exact, row):
        float_kernel()
    with b.if_then(b.icmp_signed("<", exact, T)), _row_range(kb, exact, b.sub(T, exact), row):
        k_attention_tiled.emit_tiled(kb, sig, kind)


@contextmanager
def _row_range(kb: KernelBuilder, t0: ir.Value, n: ir.Value, row_bytes: int) -> Iterator[None]:
    """Emit for the call's rows t0 .. t0+n-1 alone: as if the call had those n
    rows at position pos + t0 (queries and outputs from row t0 on)."""
    b = kb.b
    saved = kb.pos, kb.T, kb.in_raw[0], kb.out_raw
    at = b.mul(t0, i64(row_bytes))
    kb.pos, kb.T = b.add(kb.pos, t0), n
    kb.in_raw[0], kb.out_raw = kb.gep(kb.in_raw[0], at), kb.gep(kb.out_raw, at)
    try:
        yield
    finally:
        kb.pos, kb.T, kb.in_raw[0], kb.out_raw = saved


@kernel("attention_paged")
def emit_attention_paged(kb: KernelBuilder, sig: KernelSig) -> None:
    """A step's rows one by one, or (an f16 / f32 pool without a window) ROWS
    at a time through the scores pass where they are a run of one
    sequence (``_PagedRows.together``), as a single sequence's prompt chunk:
    the same bits either way, the run's pass 1 ~1.5x faster."""
    fixed = kb.static_rows(sig.in_types[0].shape)
    R = ROWS if (rows_together(sig) and pow2_divisor(int(sig.attr["head_dim"]), kb.vw) >= 8
                 and (fixed is None or fixed >= ROWS)) else 1
    _emit_attention(kb, sig, _PagedRows(kb, sig), R)


def _emit_attention(kb: KernelBuilder, sig: KernelSig, addr: _Rows, R: int = 1) -> None:
    """The kernel, a unit being one row (R = 1) or R rows (``scores_rows``: contiguous
    f32 / f16 caches without a window) of a run of query heads; each row ends with the same bits."""
    b = kb.b
    a = sig.attr
    H, KVH, hd = int(a["n_heads"]), int(a["n_kv_heads"]), int(a["head_dim"])
    scale = float(a["scale"])
    window = int(a.get("window", 0) or 0)
    group = H // KVH
    qt, kt, vt = sig.in_types[:3]
    if qt.dtype != "f32" or (qt.layout or "F32") != "F32":
        raise NotImplementedError(f"attention: native kernel needs f32 queries, got {qt}")
    kind = cache_kind(kt)
    if vt != kt:
        raise NotImplementedError(f"attention: K and V caches differ ({kt}, {vt})")
    stride = KVH * hd  # floats per cache row
    # cache elements (f32/f16) or bytes (q8) per row, and per kv head
    row_step, head_step = stride, hd
    if kind == "q8":
        if hd % QK:
            raise NotImplementedError(f"attention: a q8 cache needs head_dim a multiple of {QK}, got {hd}")
        row_step, head_step = stride // QK * Q8_BYTES, hd // QK * Q8_BYTES
    low = lowbit(kt.layout) if kind == "lowbit" else None
    if low is not None:
        if hd % GROUP or (low.rotate and low.rotate != hd):
            raise NotImplementedError(f"attention: a {kt.layout} cache does not fit head_dim {hd}")
        row_step, head_step = stride // GROUP * low.group_bytes, hd // GROUP * low.group_bytes

    exact = len(sig.in_types) == 6    # exact rows beside the low-bit ones (``ir.ops.attention``'s ``recent``)
    if exact:
        xt = sig.in_types[4]
        if low is None or cache_kind(xt) not in ("f32", "f16") or R != 1:
            raise NotImplementedError(f"attention: exact rows ({xt}) beside a low-bit cache only, got {kt}")
        recent, xring, sink_row = int(a["recent"]), int(a.get("xring") or 0), int(xt.shape[0]) - 1
        xhalf = cache_kind(xt) == "f16"
        xk, xv = (b.bitcast(kb.in_raw[i], ir.PointerType(HALF if xhalf else F32)) for i in (4, 5))
        xaddr = _Rows(kb, xring)

    slice_bytes = head_step * (4 if kind == "f32" else 2 if kind == "f16" else 1)   # a row's part of one kv head
    wd = pow2_divisor(hd, kb.vw)  # vector width over head_dim
    nvec = hd // wd
    # positions per block (``lmc kernel`` may override): f32 / f16 rows are widened into registers
    # for the block; q8 and low-bit rows are decoded per head (not measured: 8, as before)
    B = int(a.get("unroll", block_positions(nvec) if kind in ("f32", "f16") else BLOCK_MAX))
    if B < 1 or B & (B - 1) or B > 64:
        raise NotImplementedError(f"attention: positions per block must be a power of two <= 64, got {B}")
    kb.tuning["unroll"] = B

    hg = heads_per_unit(sig)
    if hg < 1 or group % hg:
        raise NotImplementedError(f"attention: {hg} heads per unit do not divide the group of {group}")
    per_unit = H // hg
    nrows = kb.rows_of(qt.shape)
    # units of rows: R rows each, but paged one row each (a run's first row takes its R rows, the others
    # of the run nothing), so that a step of decode rows keeps a unit per row and head group
    nblk = b.sdiv(b.add(nrows, i64(R - 1)), i64(R)) if R > 1 and not addr.strided else nrows
    units = b.mul(nblk, i64(per_unit))
    if addr.strided:
        lo, hi, step = kb.tid, units, kb.nthreads
    else:
        (lo, hi), step = kb.thread_share(units), 1
    q = kb.in_f32(0)
    if kind == "f32":
        kc = kb.in_f32(1)
        vc = kb.in_f32(2)
    elif kind == "f16":
        kc = b.bitcast(kb.in_raw[1], ir.PointerType(HALF))
        vc = b.bitcast(kb.in_raw[2], ir.PointerType(HALF))
    else:
        kc, vc = kb.in_raw[1], kb.in_raw[2]
    out = kb.out_f32()
    scratch = kb.fptr(kb.scratch)
    positions = _positions(sig)     # scores of one head of one row
    cap = float(a.get("softcap", 0.0) or 0.0)

    def scaled(s: ir.Value) -> ir.Value:
        """A score (or a vector of them) times the scale, soft-capped if the op says so."""
        w = s.type.count if isinstance(s.type, ir.VectorType) else None
        s = kb.fmul(s, fconst(scale, w))
        if cap:
            s = kb.fmul(kb.tanh(kb.fmul(s, fconst(1.0 / cap, w))), fconst(cap, w))
        return s

    heads = range(hg)

    def load(p: ir.Value, idx: int) -> ir.Value:
        """<wd x float> of an f32 or f16 cache row."""
        v = kb.vload(p, idx, wd)
        return v if kind == "f32" else b.fpext(v, ir.VectorType(F32, wd))

    def xload(p: ir.Value, idx: int) -> ir.Value:
        """<wd x float> of an exact row (f32 or f16)."""
        v = kb.vload(p, idx, wd)
        return b.fpext(v, ir.VectorType(F32, wd)) if xhalf else v

    def unit(t: ir.Value, hu: ir.Value, scs: list[ir.Value], scored: bool) -> None:
        """Row t, heads hu * hg ...: scores into ``scs`` (one pointer a head) unless
        ``scored`` (already there), then the softmax and the weighted sum."""
        h0 = b.mul(hu, i64(hg))     # the unit's first query head
        kvh = b.udiv(h0, i64(group))
        end = addr.end(t)
        start = kb.imax(b.sub(end, i64(window)), i64(0)) if window else i64(0)
        n = b.sub(end, start)
        nb = b.and_(n, i64(-B))  # positions covered by whole blocks
        head = b.mul(kvh, i64(head_step))
        krow = addr.rows(kc, t, start, head, row_step)  # position start+j at krow(j)
        vrow = addr.rows(vc, t, start, head, row_step)
        row = b.add(b.mul(t, i64(H)), h0)               # (t, h0) as a row of q and out
        qps = [kb.gep(q, b.mul(b.add(row, i64(i)), i64(hd))) for i in heads]
        ops = [kb.gep(out, b.mul(b.add(row, i64(i)), i64(hd))) for i in heads]
        qv = [[kb.vload(qp, c * wd, wd) for c in range(nvec)] for qp in qps]
        qv_plain = qv    # the exact rows' queries: not rotated
        if low is not None:
            if low.rotate:
                qv = [lb_emit.fwht(kb, v) for v in qv]
            gpv = GROUP // wd   # vectors of a group
            qsum = [[_vsum(kb, v[g * gpv:(g + 1) * gpv]) for g in range(hd // GROUP)] for v in qv]

        def q8_blocks(p: ir.Value, blocks: range | None = None):
            """Per block of a q8 head slice at byte pointer p (of ``blocks``,
            default all): its scale (a float) and its quants as <wd x float> pieces."""
            for blk in blocks if blocks is not None else range(hd // QK):
                bp = kb.gep(p, blk * Q8_BYTES)
                d = b.fpext(b.load(b.bitcast(bp, ir.PointerType(HALF)), align=2), F32)
                yield blk, d, [b.sitofp(kb.vload(bp, 2 + k * wd, wd), ir.VectorType(F32, wd))
                               for k in range(QK // wd)]

        def keys(j: ir.Value, row: Callable[[ir.Value], ir.Value] | None = None) -> list[ir.Value] | None:
            """An f32 / f16 key row as <wd x float> pieces, loaded (and widened) once for all
            the unit's heads; None for a quantized row, which ``dot`` decodes itself.
            ``row``: position j's exact row is at row(j) (f32 / f16)."""
            if row is not None:
                kp = row(j)
                return [xload(kp, c * wd) for c in range(nvec)]
            if kind not in ("f32", "f16"):
                return None
            kp = krow(j)
            return [load(kp, c * wd) for c in range(nvec)]

        def dot(i: int, j: ir.Value, kv: list[ir.Value] | None = None,
                qs: list[list[ir.Value]] | None = None) -> ir.Value:
            """<wd x float> partial products of k_j . q of head h0 + i (lanes still to sum);
            ``kv``: the row's pieces from ``keys(j)`` (an f32 / f16 row: loaded here if not given);
            ``qs``: the queries to take (an exact row's: not rotated)."""
            if kv is None:
                kv = keys(j)
            if kv is not None:
                qq = qv if qs is None else qs
                acc = kb.fmul(kv[0], qq[i][0])
                for c in range(1, nvec):
                    acc = fmuladd(kb, kv[c], qq[i][c], acc)
                return acc
            kp = krow(j)
            if low is not None:
                acc = None
                for g in range(hd // GROUP):
                    bp = kb.gep(kp, g * low.group_bytes)
                    d, m = lb_emit.group_scales(kb, bp)
                    cs = lb_emit.group_codes(kb, low, bp, wd)
                    s = kb.fmul(cs[0], qv[i][g * gpv])
                    for k in range(1, len(cs)):
                        s = fmuladd(kb, cs[k], qv[i][g * gpv + k], s)
                    acc = kb.fmul(s, kb.splat(d, wd)) if acc is None else fmuladd(kb, s, kb.splat(d, wd), acc)
                    acc = fmuladd(kb, qsum[i][g], kb.splat(m, wd), acc)
                return acc
            if kind == "q8":
                acc = None
                for blk, d, qs in q8_blocks(kp):
                    c0 = blk * (QK // wd)
                    s = kb.fmul(qs[0], qv[i][c0])
                    for k in range(1, len(qs)):
                        s = fmuladd(kb, qs[k], qv[i][c0 + k], s)
                    acc = kb.fmul(s, kb.splat(d, wd)) if acc is None else fmuladd(kb, s, kb.splat(d, wd), acc)
                return acc
            raise AssertionError(kind)   # f32 / f16 rows took keys() above

        def score_run(lo: ir.Value, hi: ir.Value, ms: list[ir.Value] | None,
                      row: Callable[[ir.Value], ir.Value] | None, qs: list[list[ir.Value]] | None,
                      fetch: bool) -> list[ir.Value]:
            """Pass 1 over positions [lo, hi): scores into scratch, B positions a block then
            one by one, and each head's max (folded into ``ms``). ``row``, ``qs``: exact rows'
            source and queries (``keys``, ``dot``); ``fetch``: prefetch ahead."""
            ninf = fconst(float("-inf"), B)
            last = b.sub(n, i64(1))
            nbr = b.add(lo, b.and_(b.sub(hi, lo), i64(-B)))   # positions covered by whole blocks
            with kb.loop_carry(lo, nbr, [ninf] * hg, step=B, name="sb") as (j, mvs, setv):
                if fetch:
                    # ask for the keys PREFETCH_AHEAD positions on and this block's values (pass 3 reads
                    # them), into L2. Paged: a sequence's rows jump from pool block to pool block, where
                    # the hardware's stream prefetch restarts. Contiguous: a unit reads one KV head's half
                    # of each row (stride 2 slices for Qwen2.5), and after the weights of a decode step
                    # the rows come from memory. Qwen2.5-Coder decode after a 3,500-token prompt, lmc
                    # bench, alternated: 45.5, 45.8 tok/s without, 50.4, 47.0 with; after 128 tokens
                    # 51.5 / 51.6
                    for p in range(B):
                        kb.prefetch(b.bitcast(krow(kb.imin(b.add(j, i64(PREFETCH_AHEAD + p)), last)),
                                              kb.scratch.type), slice_bytes, locality=2)
                        kb.prefetch(b.bitcast(vrow(b.add(j, i64(p))), kb.scratch.type), slice_bytes, locality=2)
                new = []
                # every key row of the block widened once before any head's dots (loaded per head, f16
                # rows were widened 7 times for Qwen2.5's unit of 7 heads: the conversions, not the
                # products, bounded the pass)
                kvs = [keys(b.add(j, i64(p)), row) for p in range(B)]
                for i in heads:
                    s = scaled(hsum_many(kb, [dot(i, b.add(j, i64(p)), kvs[p], qs) for p in range(B)]))
                    kb.vstore(s, scs[i], j)
                    new.append(kb.fmax(mvs[i], s))
                setv(new)
            m0 = [kb.hmax(v) for v in kb.last_carry]
            if ms is not None:
                m0 = [kb.fmax(x, y) for x, y in zip(ms, m0)]
            with kb.loop_carry(nbr, hi, m0, name="st") as (j, ms_, setv):
                new = []
                kv = keys(j, row)
                for i in heads:
                    s = scaled(b.extract_element(hsum_many(kb, [dot(i, j, kv, qs)]), i64(0)))
                    kb.store(s, scs[i], j)
                    new.append(kb.fmax(ms_[i], s))
                setv(new)
            return list(kb.last_carry)

        if exact:
            # the runs of visible positions (indices from start): position 0's exact row when start is 0
            # [0, s1), low-bit rows [s1, e), the last ``recent`` positions' exact rows [e, n)
            s1 = b.zext(b.icmp_signed("==", start, i64(0)), ir.IntType(64))
            e = kb.imax(b.sub(b.sub(end, i64(recent)), start), s1)
            xhead = b.mul(kvh, i64(hd))
            xrow = xaddr.rows(xk, t, b.add(start, e), xhead, stride)      # position start + e + j at xrow(j)
            xvrow = xaddr.rows(xv, t, b.add(start, e), xhead, stride)
            sink_k = kb.gep(xk, b.add(i64(sink_row * stride), xhead))
            sink_v = kb.gep(xv, b.add(i64(sink_row * stride), xhead))

        if scored:   # the scores are in place (``scores_rows``); their max per head
            nf = b.and_(n, i64(-16))
            with kb.loop_carry(0, nf, [fconst(float("-inf"), 16)] * hg, step=16, name="mr") as (j, mvs, setv):
                setv([kb.fmax(mvs[i], kb.vload(scs[i], j, 16)) for i in heads])
            m0 = [kb.hmax(v) for v in kb.last_carry]
            with kb.loop_carry(nf, n, m0, name="mrt") as (j, ms, setv):
                setv([kb.fmax(ms[i], kb.load(scs[i], j)) for i in heads])
            mx = list(kb.last_carry)
        elif exact:
            # pass 1 in three runs: the low-bit rows [s1, e), the recent exact ones [e, n), position 0's
            # exact row (the sink) when visible [0, s1)
            mx = score_run(s1, e, None, None, None, True)
            mx = score_run(e, n, mx, lambda j: xrow(b.sub(j, e)), qv_plain, False)
            mx = score_run(i64(0), s1, mx, lambda j: sink_k, qv_plain, False)
        else:
            mx = score_run(i64(0), n, None, None, None, True)
        mx_v = [kb.splat(m, B) for m in mx]

        # pass 2: p_j = exp(s_j - max) in place of the scores, and their sum per head: a
        # <B x float> per head taking block after block (then ``hsum``, then the tail one by one),
        # the exponentials EXP_LANES at a time when B is narrower (each lane's sum the same adds)
        E = max(B, EXP_LANES)
        ne = b.and_(n, i64(-E))
        mx_e = [kb.splat(m, E) for m in mx]
        with kb.loop_carry(0, ne, [fconst(0.0, B)] * hg, step=E, name="pe") as (j, sums, setv):
            new = []
            for i in heads:
                pv = exp_poly(kb, kb.fsub(kb.vload(scs[i], j, E), mx_e[i]))
                kb.vstore(pv, scs[i], j)
                acc = sums[i]
                for part in range(E // B):
                    acc = kb.fadd(acc, pv if E == B else shuffle(b, pv, None, range(part * B, (part + 1) * B)))
                new.append(acc)
            setv(new)
        with kb.loop_carry(ne, nb, kb.last_carry, step=B, name="pb") as (j, sums, setv):
            pvs = [exp_poly(kb, kb.fsub(kb.vload(scs[i], j, B), mx_v[i])) for i in heads]
            for i in heads:
                kb.vstore(pvs[i], scs[i], j)
            setv([kb.fadd(sums[i], pvs[i]) for i in heads])
        sum0 = [kb.hsum(v) for v in kb.last_carry]
        with kb.loop_carry(nb, n, sum0, name="pt") as (j, sums, setv):
            pjs = [exp_poly(kb, kb.fsub(kb.load(scs[i], j), mx[i])) for i in heads]
            for i in heads:
                kb.store(pjs[i], scs[i], j)
            setv([kb.fadd(sums[i], pjs[i]) for i in heads])
        totals = list(kb.last_carry)

        # pass 3: acc += p_j * v_j, a group of head_dim's vectors at a time (each value row's
        # group read once for the unit's heads): every head's accumulators for all of head_dim
        # (7 x 4 vectors for Qwen2.5) spilled to the stack on every position
        per_block = QK // wd if kind in ("q8", "lowbit") else 1   # vectors of a block: a group holds whole blocks
        gv = _vectors_per_group(hg, nvec, per_block)
        v_lo, v_hi = (s1, e) if exact else (0, n)    # (the exact rows' values: after the rotation back)
        for g0 in range(0, nvec, gv):
            with kb.loop_carry(v_lo, v_hi, [fconst(0.0, wd)] * (gv * hg), name="vg") as (j, cur, setv):
                accs = [list(cur[i * gv: (i + 1) * gv]) for i in heads]
                pjs = [kb.load(scs[i], j) for i in heads]
                vp = vrow(j)
                if low is not None:
                    for g in range(g0 // per_block, (g0 + gv) // per_block):
                        bp = kb.gep(vp, g * low.group_bytes)
                        d, m = lb_emit.group_scales(kb, bp)
                        cs = lb_emit.group_codes(kb, low, bp, wd)
                        for i in heads:
                            ps = kb.splat(kb.fmul(pjs[i], d), wd)
                            pm = kb.splat(kb.fmul(pjs[i], m), wd)
                            for k, cf in enumerate(cs):
                                c = g * per_block + k - g0
                                accs[i][c] = kb.fadd(fmuladd(kb, ps, cf, accs[i][c]), pm)
                elif kind == "q8":
                    for blk, d, qs in q8_blocks(vp, range(g0 // per_block, (g0 + gv) // per_block)):
                        for i in heads:
                            ps = kb.splat(kb.fmul(pjs[i], d), wd)
                            for k, qf in enumerate(qs):
                                c = blk * per_block + k - g0
                                accs[i][c] = fmuladd(kb, ps, qf, accs[i][c])
                else:
                    vs = [load(vp, (g0 + c) * wd) for c in range(gv)]
                    for i in heads:
                        ps = kb.splat(pjs[i], wd)
                        accs[i] = [fmuladd(kb, ps, vs[c], accs[i][c]) for c in range(gv)]
                setv([v for a_ in accs for v in a_])
            out_accs = kb.last_carry
            for i in heads:
                inv = kb.splat(b.fdiv(fconst(1.0), totals[i]), wd)
                for c in range(gv):
                    kb.vstore(b.fmul(out_accs[i * gv + c], inv), ops[i], (g0 + c) * wd)
        if low is not None and low.rotate:   # the weighted sum of rotated values, rotated back
            for i in heads:
                vs = lb_emit.fwht(kb, [kb.vload(ops[i], c * wd, wd) for c in range(nvec)])
                for c in range(nvec):
                    kb.vstore(vs[c], ops[i], c * wd)
        if exact:   # the exact rows' weighted sum (not rotated), added: the recent rows, then the sink
            gx = _vectors_per_group(hg, nvec, 1)
            for g0 in range(0, nvec, gx):
                accs = [fconst(0.0, wd)] * (gx * hg)
                for lo_, hi_, vp_of in ((e, n, lambda j: xvrow(b.sub(j, e))), (i64(0), s1, lambda j: sink_v)):
                    with kb.loop_carry(lo_, hi_, accs, name="vx") as (j, cur, setv):
                        vp = vp_of(j)
                        vs = [xload(vp, (g0 + c) * wd) for c in range(gx)]
                        new = []
                        for i in heads:
                            ps = kb.splat(kb.load(scs[i], j), wd)
                            new += [fmuladd(kb, ps, vs[c], cur[i * gx + c]) for c in range(gx)]
                        setv(new)
                    accs = list(kb.last_carry)
                for i in heads:
                    inv = kb.splat(b.fdiv(fconst(1.0), totals[i]), wd)
                    for c in range(gx):
                        o = kb.vload(ops[i], (g0 + c) * wd, wd)
                        kb.vstore(fmuladd(kb, accs[i * gx + c], inv, o), ops[i], (g0 + c) * wd)

    def scores_rows(t0: ir.Value, hu: ir.Value) -> None:
        """Pass 1 for rows t0 .. t0 + R - 1 (those past the chunk repeat its last) and the unit's
        heads hu * hg ...: every row's scaled scores into scratch, row r's head i at
        (r * hg + i) * positions.

        The same bits as the one-row pass, with less work: there a key's score is lane l's chain
        k[l] q[l] + k[wd + l] q[wd + l] + ... (a multiply, then fused multiply-adds), the wd lanes
        then summed by ``hsum_many``'s tree (lane l + lane l + wd/2, ...), shuffles for every key,
        head and row. Here a block of wd keys is widened once and transposed (lanes = keys) for
        all R rows x heads, and each lane chain and tree add is one vertical operation for wd keys:
        the same operations in the same order on each key, so prompt rows keep the bits of the
        decode step of the same token (tests/test_repack.py::test_one_arithmetic_for_every_row_count)."""
        KB = wd                        # keys per block: the transpose is square
        h0 = b.mul(hu, i64(hg))
        tl = kb.imin(b.add(t0, i64(R - 1)), b.sub(nrows, i64(1)))
        nl = addr.end(tl)               # keys the last row sees: every row's keys start at 0 (no window)
        last = b.sub(nl, i64(1))
        krow = addr.rows(kc, tl, i64(0), b.mul(b.udiv(h0, i64(group)), i64(head_step)), row_step)
        kt = kb.gep(scratch, R * hg * positions)      # the transposed block: kt[d * KB + k] = key k's dim d
        n_pairs = R * hg                              # head-row p: row p // hg, head p % hg of the unit
        size = -(-n_pairs // -(-n_pairs // SCORE_GROUP))     # groups of equal size, at most SCORE_GROUP

        def member(p: ir.Value) -> tuple[ir.Value, ir.Value]:
            """Head-row p's query (its row past the chunk: the last) and its scores."""
            r, i = b.udiv(p, i64(hg)), b.urem(p, i64(hg))
            row = kb.imin(b.add(t0, r), b.sub(nrows, i64(1)))
            return (kb.gep(q, b.mul(b.add(b.mul(row, i64(H)), b.add(h0, i)), i64(hd))),
                    kb.gep(scratch, b.mul(p, i64(positions))))

        def score_group(j: ir.Value, first: ir.Value, n: int) -> None:
            """Head-rows first .. first + n - 1 of key block j, sharing each key vector's load."""
            grp = [member(b.add(first, i64(x))) for x in range(n)]

            def lane(l_: int) -> list[ir.Value]:
                """Lane l_'s chains (a multiply, then multiply-adds over head_dim's
                vectors c): unrolled for a few vectors, else a loop (head_dim 256:
                unrolled, the chains were most of the kernel's code and compile time)."""
                def step(d: ir.Value | int, accs: list[ir.Value] | None) -> list[ir.Value]:
                    kd = kb.vload(kt, b.mul(d, i64(KB)) if isinstance(d, ir.Value) else d * KB, KB)
                    qds = [kb.splat(kb.load(qp, d), KB) for qp, _ in grp]
                    if accs is None:
                        return [kb.fmul(kd, qd) for qd in qds]
                    return [fmuladd(kb, kd, qd, a) for qd, a in zip(qds, accs)]
                accs = step(l_, None)
                if nvec <= UNROLLED_CHAIN:
                    for c in range(1, nvec):
                        accs = step(c * wd + l_, accs)
                    return accs
                with kb.loop_carry(1, nvec, accs, name="lch") as (c, cur, setv):
                    setv(step(b.add(b.mul(c, i64(wd)), i64(l_)), list(cur)))
                return list(kb.last_carry)

            def folded(l_: int, h: int) -> list[ir.Value]:
                """Lane l_ after the tree's fold of half h (``hsum_many``: lane l_ + lane l_ + h)."""
                if h == wd:
                    return lane(l_)
                return [kb.fadd(x, y) for x, y in zip(folded(l_, 2 * h), folded(l_ + h, 2 * h))]
            for (_, sp), v in zip(grp, folded(0, 1)):
                kb.vstore(scaled(v), sp, j)

        with kb.loop(0, nl, step=KB, name="kblk") as j:
            rows = [krow(kb.imin(b.add(j, i64(k)), last)) for k in range(KB)]   # past the end: the last key again
            for c in range(nvec):
                cols = _transpose(kb, [load(kp, c * wd) for kp in rows])
                for l_ in range(wd):
                    kb.vstore(cols[l_], kt, (c * wd + l_) * KB)
            # the groups' code once, in a loop (emitted per group, it was most of a chunk
            # kernel's code and of its compile time); a smaller last group after it
            full = n_pairs // size
            with kb.loop(0, full * size, step=size, name="sgrp") as first:
                score_group(j, first, size)
            if n_pairs % size:
                score_group(j, i64(full * size), n_pairs % size)

    with kb.loop(lo, hi, step=step, name="unit") as u:
        if addr.strided:    # t-major: a paged step's rows are different sequences
            t, hu = b.udiv(u, i64(per_unit)), b.urem(u, i64(per_unit))
        else:               # head-group-major: a thread's share keeps to few KV heads (see below)
            t, hu = b.urem(u, nblk), b.udiv(u, nblk)
        if R == 1:
            unit(t, hu, [kb.gep(scratch, i * positions) for i in heads], False)
        else:
            t0 = b.mul(t, i64(R)) if not addr.strided else b.sub(t, b.urem(t, i64(R)))

            def rows_at_once() -> None:
                scores_rows(t0, hu)
                with kb.loop(0, R, name="rrow") as r:    # passes 2 and 3 per row, their code once
                    tr = b.add(t0, r)
                    with kb.if_then(b.icmp_signed("<", tr, nrows)):
                        unit(tr, hu, [kb.gep(scratch, b.mul(b.add(b.mul(r, i64(hg)), i64(i)), i64(positions)))
                                      for i in heads], True)
            together = addr.together(t0, R, nrows)
            if together is None:
                rows_at_once()
            else:   # paged: a run's R rows by its first row's unit, any other row (decode rows, two sequences) alone
                with b.if_else(together) as (yes, no):
                    with yes, kb.if_then(b.icmp_signed("==", t, t0)):
                        rows_at_once()
                    with no:
                        unit(t, hu, [kb.gep(scratch, i * positions) for i in heads], False)


def _transpose(kb: KernelBuilder, rows: list[ir.Value]) -> list[ir.Value]:
    """n vectors of n floats (n a power of two) -> the n columns: log2(n) rounds of two-input
    shuffles, each swapping the off-diagonal h x h blocks of every 2h x 2h block."""
    n = len(rows)
    m = list(rows)
    h = n // 2
    while h >= 1:
        lo = [k if (k // h) % 2 == 0 else n + k - h for k in range(n)]
        hi = [k + h if (k // h) % 2 == 0 else n + k for k in range(n)]
        for r in range(n):
            if (r // h) % 2 == 0:
                m[r], m[r + h] = shuffle(kb.b, m[r], m[r + h], lo), shuffle(kb.b, m[r], m[r + h], hi)
        h //= 2
    return m


def _vsum(kb: KernelBuilder, vs: list[ir.Value]) -> ir.Value:
    """Lane-wise sum of vectors (a group's q: its lanes still to be summed)."""
    acc = vs[0]
    for v in vs[1:]:
        acc = kb.fadd(acc, v)
    return acc

