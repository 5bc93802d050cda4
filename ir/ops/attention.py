"""Attention against the KV cache and the ops that write it: one
sequence's contiguous cache (``kv_write``, ``attention``, and RoPE fused
with the write), and a pool of blocks shared by a batch of sequences, each
addressing its own through a block table (the ``_paged`` ops).

A sliding-window layer's contiguous cache may be a ring (attribute
``ring`` = R on its write and its attention): position p lives in row
p % R, so the cache holds R positions however long the context (llama.cpp's
SWA cache). R is the window plus the most rows one step writes: a step
writes all its rows before any attends, and its first row still needs the
window before it (``ring_rows``).

A write may subtract a constant row first (attribute ``offset``: one float
per value of a cache row): the key offset of a low-bit cache
(``ir.kv_lowbit``). Attention reads the rows as stored: a key k - m scores
q.k - q.m, the same shift for every position a query sees, which softmax
cancels (not under a soft cap: the builder gives such layers none).

Beside a low-bit cache, attention may read some positions exactly
(``recent`` = R, two more operands: an f16 K and V cache of the exact rows,
``ir.kv_lowbit.RECENT``): a query at position p takes positions
p - R + 1 .. p and position 0 (the attention sink) from them, the rest
from the low-bit rows, relative to each query row, so a token's numbers do
not depend on how rows were batched. That cache is a ring of ``xring``
rows (position q at row q % xring; 0: position q at row q) and one more,
its last, which keeps position 0 (its write's ``sink``)."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..kv_codec import KV_BLOCK, kv_decode, kv_rotation, kv_row_width, kv_store
from ..kv_lowbit import fwht, lowbit
from ..types import Dim, TensorType
from .elementwise import softcap_ref
from .registry import need, register
from .rope import rope_ref, rope_type


def _kv_cache_ok(t: TensorType, what: str) -> None:
    """KV cache storage: f32 or f16 values, Q8_0 blocks or low-bit groups (ir.types.KV_TYPES)."""
    if t.layout is None:
        need(t.dtype in ("f32", "f16"), f"{what}: a KV cache of {t.dtype} is not supported (f32, f16, Q8_0)")
    else:
        lb = lowbit(t.layout)
        need((t.layout == "Q8_0" or lb is not None) and isinstance(t.shape[1], int) and t.shape[1] % KV_BLOCK == 0,
              f"{what}: a KV cache {t} is not supported (f32, f16, or Q8_0 / KV_Q4 / KV_Q2 rows of whole blocks)")
        need(lb is None or not lb.rotate or t.shape[1] % lb.rotate == 0,
              f"{what}: a {t.layout} cache row of {t.shape[1]} values is not whole heads of {lb and lb.rotate}")


def _kv_write(ts: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    cache, x, pos = ts
    need(cache.rank == 2 and x.shape[-1] == cache.shape[1], f"kv_write: {x} does not fit cache {cache}")
    _kv_cache_ok(cache, "kv_write")
    need(attrs.get("sink") in (None, 0, 1) and (not attrs.get("sink") or cache.layout is None),
          f"kv_write: sink must be 0 or 1 (an f32 or f16 cache), got {attrs.get('sink')!r}")
    _ring_ok(cache, attrs, "kv_write")
    _offset_ok(cache, attrs, "kv_write")
    return cache


def _offset_ok(cache: TensorType, attrs: dict[str, Any], what: str) -> None:
    """An offset is one float per value of a cache row."""
    off = attrs.get("offset")
    need(off is None or (isinstance(off, tuple) and len(off) == cache.shape[1]
                         and all(isinstance(v, float) for v in off)),
          f"{what}: offset must be a tuple of {cache.shape[1]} floats")


def subtract_offset(x: Any, offset: tuple[float, ...] | None) -> np.ndarray:
    """x's rows minus the write's offset (float32, as the kernels subtract)."""
    x = np.asarray(x, np.float32)
    if offset is None:
        return x
    return x.reshape(-1, len(offset)) - np.asarray(offset, np.float32)


def _ring_ok(cache: TensorType, attrs: dict[str, Any], what: str) -> None:
    """A ring holds exactly its R rows."""
    ring = attrs.get("ring")
    need(ring is None or (isinstance(ring, int) and ring > 0 and cache.shape[0] == ring + int(attrs.get("sink") or 0)),
          f"{what}: ring {ring!r} does not match a cache of {cache.shape[0]} rows")


def ring_rows(window: int, max_rows: int) -> int:
    """Rows of a sliding-window layer's ring: its window plus the rows one
    step writes (a prompt chunk, a speculative check) before attending."""
    return int(window) + int(max_rows)


def sliding_window(graph: Any) -> int:
    """The window every attention node of ``graph`` slides by (a Mistral
    file), 0 if any of them sees the whole sequence."""
    wins = [int(n.attrs.get("window") or 0) for n in graph.nodes if n.op in ("attention", "attention_paged")]
    return max(wins) if wins and min(wins) > 0 else 0


def cache_rows(p0: int, p1: int, ring: int | None) -> np.ndarray | slice:
    """Cache rows of positions p0..p1-1 (a ring wraps them)."""
    return np.arange(p0, p1) % ring if ring else slice(p0, p1)


def _attention(ts: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    need(len(ts) in (4, 6), f"attention takes q, k and v caches, pos and optionally the exact rows' caches, "
                            f"got {len(ts)} operands")
    q, kc, vc, pos = ts[:4]
    h, kvh, hd = attrs["n_heads"], attrs["n_kv_heads"], attrs["head_dim"]
    if len(ts) == 6:
        kx, vx = ts[4:]
        recent, xring = attrs.get("recent"), attrs.get("xring") or 0
        need(isinstance(recent, int) and recent > 0, f"attention: exact rows need recent > 0, got {recent!r}")
        need(isinstance(xring, int) and (xring == 0 or xring > recent),
              f"attention: a ring of exact rows must hold more than {recent} rows, got {xring!r}")
        need(kx == vx and kx.layout is None and kx.dtype in ("f32", "f16") and kx.rank == 2
              and kx.shape[1] == kvh * hd and (not xring or kx.shape[0] == xring + 1),
              f"attention: exact rows' caches {kx}, {vx} do not fit")
    else:
        need(not attrs.get("recent"), "attention: recent needs the exact rows' caches")
    need(q.shape[-1] == h * hd, f"attention: {q} is not {h} heads of {hd}")
    need(kc == vc and kc.shape[-1] == kvh * hd, f"attention: caches {kc}, {vc} do not fit")
    _kv_cache_ok(kc, "attention")
    _ring_ok(kc, attrs, "attention")
    need(not attrs.get("ring") or 0 < int(attrs.get("window") or 0) < int(attrs["ring"]),
          f"attention: a ring of {attrs.get('ring')} rows needs a window shorter than it")
    need(kc.layout is None or hd % KV_BLOCK == 0, f"attention: a {kc.layout} cache needs head_dim a multiple of {KV_BLOCK}")
    rot = lowbit(kc.layout).rotate if lowbit(kc.layout) else 0
    need(not rot or rot == hd, f"attention: a {kc.layout} cache is rotated over {rot} values, not head_dim {hd}")
    need(h % kvh == 0, f"attention: {h} query heads not a multiple of {kvh} kv heads")
    return TensorType(q.shape, "f32")


def _paged_operands(ts: list[TensorType], rows: Dim, attrs: dict[str, Any], what: str) -> None:
    """``positions[T]`` and ``block_tables[T, MAXB]`` (i32) for ``rows`` rows,
    and a pool (the cache, first of ``ts``) of whole blocks."""
    pool, positions, tables = ts
    bs = attrs.get("block_size")
    need(isinstance(bs, int) and bs > 0, f"{what}: block_size must be a positive int, got {bs!r}")
    need(isinstance(pool.shape[0], int) and pool.shape[0] % bs == 0,
          f"{what}: a pool of {pool.shape[0]} rows is not whole blocks of {bs}")
    need(positions.dtype == "i32" and positions.rank == 1 and positions.shape[0] == rows,
          f"{what}: positions must be i32[{rows}], got {positions}")
    need(tables.dtype == "i32" and tables.rank == 2 and tables.shape[0] == rows and isinstance(tables.shape[1], int),
          f"{what}: block tables must be i32[{rows}, blocks], got {tables}")


def _kv_write_paged(ts: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    cache, x, positions, tables = ts
    need(cache.rank == 2 and x.rank == 2 and x.shape[-1] == cache.shape[1],
          f"kv_write_paged: {x} does not fit pool {cache}")
    _kv_cache_ok(cache, "kv_write_paged")
    _offset_ok(cache, attrs, "kv_write_paged")
    _paged_operands([cache, positions, tables], x.shape[0], attrs, "kv_write_paged")
    return cache


def _rope_kv_fits(cache: TensorType, attrs: dict[str, Any], what: str) -> None:
    """A q8 (or low-bit) cache row is blocks of 32: the fused kernel rotates a
    head, then quantizes it, so each head must be whole blocks (and a
    Hadamard-rotated cache's rotation one head)."""
    need(cache.layout is None or int(attrs["head_dim"]) % KV_BLOCK == 0,
          f"{what}: a {cache.layout} cache needs head_dim a multiple of {KV_BLOCK}")
    lb = lowbit(cache.layout)
    need(lb is None or not lb.rotate or lb.rotate == int(attrs["head_dim"]),
          f"{what}: a {cache.layout} cache is rotated over {lb and lb.rotate} values, not head_dim {attrs['head_dim']}")


def _rope_kv_write(ts: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    need(len(ts) in (3, 4), f"rope_kv_write takes cache, x, pos and optionally frequency factors, got {len(ts)}")
    cache, x, pos = ts[:3]
    need(pos.rank == 0, f"rope_kv_write: pos must be an i32 scalar, got {pos}")
    rotated = rope_type([x, pos, *ts[3:]], attrs)
    _rope_kv_fits(cache, attrs, "rope_kv_write")
    return _kv_write([cache, rotated, pos], {"ring": attrs.get("ring"), "offset": attrs.get("offset")})


def _rope_kv_write_paged(ts: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    need(len(ts) in (4, 5), f"rope_kv_write_paged takes pool, x, positions, tables and optionally frequency "
                             f"factors, got {len(ts)}")
    cache, x, positions, tables = ts[:4]
    rope = {k: v for k, v in attrs.items() if k not in ("block_size", "offset")}
    rotated = rope_type([x, positions, *ts[4:]], rope)
    _rope_kv_fits(cache, attrs, "rope_kv_write_paged")
    return _kv_write_paged([cache, rotated, positions, tables],
                           {"block_size": attrs.get("block_size"), "offset": attrs.get("offset")})


def _attention_paged(ts: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    q, kc, vc, positions, tables = ts
    need(q.rank == 2, f"attention_paged: queries must be [T, heads x head_dim], got {q}")
    out = _attention([q, kc, vc, TensorType((), "i32")], attrs)
    _paged_operands([kc, positions, tables], q.shape[0], attrs, "attention_paged")
    return out


@register("kv_write", 3, _kv_write, updates_state=True)
def kv_write_ref(cache: np.ndarray, x: np.ndarray, pos: Any, *, ring: int | None = None,
                 offset: tuple[float, ...] | None = None, sink: int = 0) -> np.ndarray:
    """Store the new rows (minus ``offset``) at positions pos.. (in place: the
    cache is state), rounded to the cache's storage (``_kv_store``); a ring
    at rows p % R. ``sink``: the cache's last row also keeps position 0."""
    n = int(np.size(x)) // kv_row_width(cache)
    p = int(pos)
    rows = cache.shape[0] - int(sink)
    if p < 0 or (p + n > rows and not ring) or (ring and n > ring):
        raise IndexError(f"kv_write at {p}..{p + n} outside a cache of {rows}")
    x = subtract_offset(x, offset)
    if sink and p == 0 and n:
        kv_store(cache, rows, x.reshape(n, -1)[:1])
    return kv_store(cache, cache_rows(p, p + n, ring), x)


def _attend(qrow: np.ndarray, k: np.ndarray, v: np.ndarray, group: int, scale: float,
            softcap: float = 0.0) -> np.ndarray:
    """One query row's heads [H, hd] against its visible K/V rows [n, KVH, hd].
    ``softcap`` bounds each score to (-c, c) as c * tanh(s / c) (Gemma 2)."""
    out = np.empty_like(qrow)
    for h in range(qrow.shape[0]):
        kv = h // group
        sc = (k[:, kv, :] @ qrow[h]) * np.float32(scale)
        if softcap:
            sc = softcap_ref(sc, cap=softcap)
        sc = np.exp(sc - sc.max())
        sc /= sc.sum(dtype=np.float32)
        out[h] = sc @ v[:, kv, :]
    return out


def _visible(end: int, window: int) -> int:
    """First position a query at position end-1 sees."""
    return max(0, end - window) if window else 0


@register("attention", -1, _attention)
def attention_ref(q: np.ndarray, kc: np.ndarray, vc: np.ndarray, pos: Any, kx: np.ndarray | None = None,
                  vx: np.ndarray | None = None, *, n_heads: int, n_kv_heads: int, head_dim: int, scale: float,
                  window: int = 0, softcap: float = 0.0, ring: int | None = None, recent: int = 0,
                  xring: int = 0) -> np.ndarray:
    """Causal grouped-query attention against the cache. Row t of q sits at
    position pos+t and sees positions <= pos+t (and > pos+t-window if set),
    in a ring at rows p % ring; with ``recent``, its last ``recent``
    positions and position 0 are read from the exact rows ``kx``, ``vx``."""
    if recent:
        return _attention_exact(q, kc, vc, pos, kx, vx, n_heads, n_kv_heads, head_dim, scale, window, softcap,
                                ring, recent, xring)
    q = np.asarray(q, np.float32)
    lead = q.shape[:-1]
    rot = kv_rotation(kc)
    qs = (fwht(q, rot) if rot else q).reshape(-1, n_heads, head_dim)
    p0 = int(pos)
    if ring and qs.shape[0] > ring - window:
        raise IndexError(f"attention: {qs.shape[0]} rows overwrite the window of their first row in a ring of "
                         f"{ring} (at most {ring - window} rows a step)")
    out = np.empty_like(qs)
    for t in range(qs.shape[0]):
        end = p0 + t + 1
        start = _visible(end, window)
        k = kv_decode(kc[cache_rows(start, end, ring)]).reshape(end - start, n_kv_heads, head_dim)
        v = kv_decode(vc[cache_rows(start, end, ring)]).reshape(end - start, n_kv_heads, head_dim)
        out[t] = _attend(qs[t], k, v, n_heads // n_kv_heads, scale, softcap)
    return _unrotate(out, rot).reshape(lead + (n_heads * head_dim,))


def _attention_exact(q: np.ndarray, kc: np.ndarray, vc: np.ndarray, pos: Any, kx: np.ndarray, vx: np.ndarray,
                     n_heads: int, n_kv_heads: int, head_dim: int, scale: float, window: int, softcap: float,
                     ring: int | None, recent: int, xring: int) -> np.ndarray:
    """``attention_ref`` with exact rows: each row's visible positions, the
    low-bit ones decoded and their rotation undone, the exact ones (its last
    ``recent`` and position 0, from the sink row) from ``kx``, ``vx``."""
    q = np.asarray(q, np.float32)
    lead = q.shape[:-1]
    rot = kv_rotation(kc)
    qs = q.reshape(-1, n_heads, head_dim)
    p0 = int(pos)
    if (ring and qs.shape[0] > ring - window) or (xring and qs.shape[0] > xring - recent):
        raise IndexError(f"attention: {qs.shape[0]} rows overwrite rows their first row reads in a ring")
    sink_row = kx.shape[0] - 1
    out = np.empty_like(qs)
    for t in range(qs.shape[0]):
        end = p0 + t + 1
        start = _visible(end, window)
        k = _unrotate(kv_decode(kc[cache_rows(start, end, ring)]), rot)
        v = _unrotate(kv_decode(vc[cache_rows(start, end, ring)]), rot)
        js = np.arange(start, end)
        exact = (js == 0) | (js >= end - recent)
        xrows = np.where(js == 0, sink_row, js % xring if xring else js)[exact]
        k[exact], v[exact] = kv_decode(kx[xrows]), kv_decode(vx[xrows])
        out[t] = _attend(qs[t], k.reshape(end - start, n_kv_heads, head_dim),
                         v.reshape(end - start, n_kv_heads, head_dim), n_heads // n_kv_heads, scale, softcap)
    return out.reshape(lead + (n_heads * head_dim,))


def _unrotate(out: np.ndarray, rot: int) -> np.ndarray:
    """A rotated cache's weighted sum of values is H times the true one (a
    rotated query gives the same scores): H is its own inverse."""
    return fwht(out, rot) if rot else out


def paged_rows(positions: Any, tables: Any, block_size: int, pool_rows: int) -> list[np.ndarray]:
    """Per batch row r: the pool rows of its sequence's positions 0..positions[r]
    (pool row of position p = tables[r, p // block_size] * block_size +
    p % block_size). Raises IndexError for a negative position, a position
    past the table, or a table entry it uses outside the pool."""
    pos = np.asarray(positions, np.int64).reshape(-1)
    tab = np.asarray(tables, np.int64)
    n_blocks = pool_rows // block_size
    out = []
    for r, p in enumerate(pos):
        if p < 0 or p // block_size >= tab.shape[1]:
            raise IndexError(f"row {r}: position {p} outside the block table ({tab.shape[1]} blocks of "
                             f"{block_size})")
        used = tab[r, : p // block_size + 1]
        if used.min() < 0 or used.max() >= n_blocks:
            raise IndexError(f"row {r}: block table entry outside the pool of {n_blocks} blocks")
        ps = np.arange(p + 1)
        out.append(used[ps // block_size] * block_size + ps % block_size)
    return out


@register("kv_write_paged", 4, _kv_write_paged, updates_state=True)
def kv_write_paged_ref(cache: np.ndarray, x: np.ndarray, positions: Any, tables: Any, *,
                       block_size: int, offset: tuple[float, ...] | None = None) -> np.ndarray:
    """Row r of x (minus ``offset``) goes to its sequence's position
    positions[r], at the pool row its block table gives (in place), rounded
    as ``kv_write``."""
    rows = [r[-1] for r in paged_rows(positions, tables, block_size, cache.shape[0])]
    return kv_store(cache, np.asarray(rows, np.int64), subtract_offset(x, offset))


@register("rope_kv_write", -1, _rope_kv_write, updates_state=True)
def rope_kv_write_ref(cache: np.ndarray, x: np.ndarray, pos: Any, freq_factors: Any = None,
                      ring: int | None = None, offset: tuple[float, ...] | None = None, **rope: Any) -> np.ndarray:
    """``kv_write(cache, rope(x, pos), pos)`` as one op (``passes.fuse_elementwise``):
    the two references in turn, so the same float32 steps and the same rounding."""
    return kv_write_ref(cache, rope_ref(x, pos, freq_factors, **rope), pos, ring=ring, offset=offset)


@register("rope_kv_write_paged", -1, _rope_kv_write_paged, updates_state=True)
def rope_kv_write_paged_ref(cache: np.ndarray, x: np.ndarray, positions: Any, tables: Any,
                            freq_factors: Any = None, *, block_size: int, offset: tuple[float, ...] | None = None,
                            **rope: Any) -> np.ndarray:
    """``kv_write_paged(pool, rope(x, positions), positions, tables)`` as one op."""
    return kv_write_paged_ref(cache, rope_ref(x, positions, freq_factors, **rope), positions, tables,
                              block_size=block_size, offset=offset)


@register("attention_paged", 5, _attention_paged)
def attention_paged_ref(q: np.ndarray, kc: np.ndarray, vc: np.ndarray, positions: Any, tables: Any, *,
                        n_heads: int, n_kv_heads: int, head_dim: int, scale: float, window: int = 0,
                        block_size: int, softcap: float = 0.0) -> np.ndarray:
    """``attention`` for a batch of sequences in a pool: row t sits at its
    own sequence's position positions[t] and sees that sequence's positions
    max(0, positions[t] - window + 1)..positions[t] (from 0 without a
    window), read through its block table."""
    q = np.asarray(q, np.float32)
    rot = kv_rotation(kc)
    qs = (fwht(q, rot) if rot else q).reshape(-1, n_heads, head_dim)
    out = np.empty_like(qs)
    for t, rows in enumerate(paged_rows(positions, tables, block_size, kc.shape[0])):
        rows = rows[_visible(len(rows), window):]
        k = kv_decode(kc[rows]).reshape(len(rows), n_kv_heads, head_dim)
        v = kv_decode(vc[rows]).reshape(len(rows), n_kv_heads, head_dim)
        out[t] = _attend(qs[t], k, v, n_heads // n_kv_heads, scale, softcap)
    return _unrotate(out, rot).reshape(q.shape)
