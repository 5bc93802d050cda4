"""Native kernels of the paged batch graph against their numpy references:
``kv_write_paged``, ``attention_paged`` and ``rope`` with one position per row.

A batch holds rows of several sequences (single decode rows and runs of
consecutive positions of one sequence, shuffled together); each sequence
owns blocks scattered through the pool (a shuffled permutation of block
ids), and may share its first block with another (a common prefix). Pool
rows nobody may read are NaN, as are whole blocks that table entries past a
row's last block point to; all three KV storage types, sliding windows,
several block sizes, thread counts and vector widths (4, 8 and the host's).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from compiler.codegen.harness import sig_for
from ir import kv_codec, ops
from ir.interp import state_array
from ir.types import TensorType, f32, i32, kv_cache_type
from test_kernels_attention import HOST_VW, WIDTHS, close, run
from test_kv_cache import poison

rng = np.random.default_rng(11)
threads = st.integers(1, 3)
widths = st.sampled_from(WIDTHS)
KINDS = ["f32", "f16", "q8"]


@dataclass
class Batch:
    """Rows of a batch step and the pool layout behind them."""

    positions: np.ndarray     # i32 [T]
    tables: np.ndarray        # i32 [T, MAXB]
    seq: list[int]            # sequence of each row
    seq_tables: list[np.ndarray]
    lens: list[int]           # positions each sequence has, this step's included
    n_blocks: int
    block_size: int
    shared: bool

    def pool_row(self, s: int, p: int) -> int:
        return int(self.seq_tables[s][p // self.block_size]) * self.block_size + p % self.block_size


def make_batch(lens: list[int], ks: list[int], bs: int, share: bool, spare: int = 2) -> Batch:
    """Sequences of ``lens`` positions whose last ``ks[s]`` are this step's
    rows (in shuffled order); block ids a permutation of the pool, and an
    all-NaN block that table entries past a sequence's blocks point to.
    ``share``: sequence 1 reads sequence 0's first block (a common prefix;
    only when neither writes into it this step)."""
    need = [-(-n // bs) for n in lens]
    maxb = max(need) + 1
    nb = sum(need) + spare + 1
    ids = rng.permutation(nb)
    dead = ids[-1]
    tabs, i = [], 0
    for n in need:
        t = np.full(maxb, dead, np.int32)
        t[:n] = ids[i: i + n]
        i += n
        tabs.append(t)
    shared = share and len(lens) > 1 and min(lens[0] - ks[0], lens[1] - ks[1]) >= bs
    if shared:
        tabs[1][0] = tabs[0][0]
    rows = [(s, p) for s in range(len(lens)) for p in range(lens[s] - ks[s], lens[s])]
    order = rng.permutation(len(rows))
    rows = [rows[j] for j in order]
    return Batch(np.array([p for _, p in rows], np.int32), np.stack([tabs[s] for s, _ in rows]),
                 [s for s, _ in rows], tabs, lens, nb, bs, shared)


seqs = st.lists(st.tuples(st.integers(1, 40), st.integers(1, 3)), min_size=1, max_size=4)


def lens_ks(spec) -> tuple[list[int], list[int]]:
    return [n for n, _ in spec], [min(k, n) for n, k in spec]


def pool(kind: str, b: Batch, width: int) -> np.ndarray:
    """A pool whose sequences' positions hold data and every other row NaN."""
    c = state_array(kv_cache_type(kind, b.n_blocks * b.block_size, width))
    poison(c, slice(None))
    for s, n in enumerate(b.lens):
        rows = [b.pool_row(s, p) for p in range(n)]
        kv_codec.kv_store(c, np.asarray(rows), rng.standard_normal((n, width)).astype(np.float32))
    return c


# --- kv_write_paged ---------------------------------------------------------------
@given(spec=seqs, D=st.sampled_from([1, 8, 24, 32, 40, 64]), bs=st.sampled_from([1, 2, 3, 4, 16]),
       kind=st.sampled_from(KINDS), nt=threads, vw=widths)
@settings(deadline=None, max_examples=60)
def test_kv_write_paged(spec, D, bs, kind, nt, vw):
    if kind == "q8":
        D = 32 * max(1, D // 32)
    lens, ks = lens_ks(spec)
    b = make_batch(lens, ks, bs, share=False)
    T = len(b.positions)
    ct = kv_cache_type(kind, b.n_blocks * bs, D)
    cache = state_array(ct)
    cache[...] = rng.integers(0, 256, cache.nbytes, dtype=np.uint8).view(cache.dtype).reshape(cache.shape)
    x = (rng.standard_normal((T, D)) * 10).astype(np.float32)
    sig = sig_for("kv_write_paged", [ct, f32("T", D), i32("T"), i32("T", b.tables.shape[1])], block_size=bs)
    want = ops.kv_write_paged_ref(cache.copy(), x, b.positions, b.tables, block_size=bs)
    got = run(sig, [cache, x, b.positions, b.tables], T=T, nthreads=nt, vw=vw, out=cache)
    assert got is cache
    np.testing.assert_array_equal(cache.view(np.uint8), want.view(np.uint8))  # bit for bit, other rows untouched


# --- attention_paged ---------------------------------------------------------------
def attention_paged_case(kind, spec, hd, kvh, group, bs, window, share, nt, vw, qscale=1.0):
    H = kvh * group
    lens, ks = lens_ks(spec)
    b = make_batch(lens, ks, bs, share)
    T = len(b.positions)
    kc, vc = pool(kind, b, kvh * hd), pool(kind, b, kvh * hd)
    if window and not b.shared:  # positions before every row's window: nobody may read them
        for s, n in enumerate(lens):
            first = min(max(0, p + 1 - window) for p, r in zip(b.positions, b.seq) if r == s)
            for p in range(first):
                for c in (kc, vc):
                    poison(c, slice(b.pool_row(s, p), b.pool_row(s, p) + 1))
    q = (rng.standard_normal((T, H * hd)) * qscale).astype(np.float32)
    attrs = dict(n_heads=H, n_kv_heads=kvh, head_dim=hd, scale=1.0 / math.sqrt(hd), window=window, block_size=bs)
    ct = kv_cache_type(kind, b.n_blocks * bs, kvh * hd)
    sig = sig_for("attention_paged", [f32("T", H * hd), ct, ct, i32("T"), i32("T", b.tables.shape[1])], **attrs)
    want = ops.attention_paged_ref(q, kc, vc, b.positions, b.tables, **attrs)
    assert np.isfinite(want).all()
    got = run(sig, [q, kc, vc, b.positions, b.tables], T=T, nthreads=nt, vw=vw)
    close(got, want, rtol=1e-4, atol=2e-5)


@given(spec=seqs, hd=st.sampled_from([2, 6, 8, 16, 24, 64]), kvh=st.integers(1, 3), group=st.integers(1, 4),
       bs=st.sampled_from([1, 2, 3, 4, 16]), window=st.one_of(st.just(0), st.integers(1, 9)), share=st.booleans(),
       nt=threads, vw=widths)
@settings(deadline=None, max_examples=80)
def test_attention_paged(spec, hd, kvh, group, bs, window, share, nt, vw):
    attention_paged_case("f32", spec, hd, kvh, group, bs, window, share, nt, vw)


@given(spec=seqs, kind=st.sampled_from(["f16", "q8"]), hd=st.sampled_from([32, 64]), kvh=st.integers(1, 2),
       group=st.integers(1, 3), bs=st.sampled_from([1, 4, 16]), window=st.one_of(st.just(0), st.integers(1, 9)),
       share=st.booleans(), nt=threads, vw=widths)
@settings(deadline=None, max_examples=50)
def test_attention_paged_f16_q8(spec, kind, hd, kvh, group, bs, window, share, nt, vw):
    attention_paged_case(kind, spec, hd, kvh, group, bs, window, share, nt, vw)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("window", [0, 100])
def test_attention_paged_long_rows(kind, window):
    """Rows hundreds of positions long across many blocks, mixed with short ones."""
    attention_paged_case(kind, [(700, 1), (3, 1), (260, 3), (1, 1)], 64, 2, 2, 16, window, True, 2, HOST_VW)


@pytest.mark.parametrize("kind", ["f32", "f16"])
@pytest.mark.parametrize("vw", [8, HOST_VW])
@pytest.mark.parametrize("nt", [1, 3])
def test_attention_paged_runs_have_the_bits_of_single_rows(kind, vw, nt):
    """Prompt chunks in a step (runs of one sequence's consecutive
    positions) take the scores pass ``ROWS`` rows at a time; a block of rows
    that is not such a run (a decode row, two sequences, one of them
    continuing where the other's positions stop, sharing its first blocks)
    goes row by row. Every row has, bit for bit, what it gets alone in a
    step of one row."""
    from compiler.codegen import k_attention

    bs, hd, kvh, group = 16, 64, 2, 2
    H = kvh * group
    # A: a 13-row chunk at 47..59; D: shares A's first 3 blocks, its chunk at 60..65 right after A's rows,
    # so a block of ROWS rows holds A's 58, 59 and D's 60, 61 (consecutive, other tables); B, E: decode rows
    lens, ks = [60, 30, 66, 9], [13, 1, 6, 1]
    b = make_batch(lens, ks, bs, share=False)
    tabs = b.seq_tables
    tabs[2][:3] = tabs[0][:3]
    order = [(1, 29)] + [(0, p) for p in range(47, 60)] + [(2, p) for p in range(60, 66)] + [(3, 8)]
    positions = np.array([p for _, p in order], np.int32)
    tables = np.stack([tabs[s] for s, _ in order])
    b = Batch(positions, tables, [s for s, _ in order], tabs, lens, b.n_blocks, bs, True)
    kc, vc = pool(kind, b, kvh * hd), pool(kind, b, kvh * hd)
    for s in (0, 2):   # D's rows before 48 are A's: the same pool rows, written once
        assert [b.pool_row(s, p) for p in range(48)] == [b.pool_row(0, p) for p in range(48)]
    T = len(order)
    q = rng.standard_normal((T, H * hd)).astype(np.float32)
    attrs = dict(n_heads=H, n_kv_heads=kvh, head_dim=hd, scale=1.0 / math.sqrt(hd), window=0, block_size=bs)
    ct = kv_cache_type(kind, b.n_blocks * bs, kvh * hd)
    sig = sig_for("attention_paged", [f32("T", H * hd), ct, ct, i32("T"), i32("T", tables.shape[1])], **attrs)
    assert k_attention.rows_together(sig) and k_attention.ROWS == 4
    got = run(sig, [q, kc, vc, positions, tables], T=T, nthreads=nt, vw=vw)
    close(got, ops.attention_paged_ref(q, kc, vc, positions, tables, **attrs), rtol=1e-4, atol=2e-5)
    for r in range(T):
        alone = run(sig, [q[r: r + 1], kc, vc, positions[r: r + 1], tables[r: r + 1]], T=1, nthreads=1, vw=vw)
        np.testing.assert_array_equal(got[r], alone[0], err_msg=f"row {r}: {order[r]}")


def test_attention_paged_peaked_scores():
    for vw in WIDTHS:
        attention_paged_case("f32", [(37, 2), (20, 1)], 16, 2, 2, 4, 0, False, 2, vw, qscale=30.0)


# --- rope with per-row positions ------------------------------------------------------
@given(T=st.integers(1, 6), hd=st.sampled_from([2, 8, 16, 64, 128]), heads=st.integers(1, 3),
       top=st.sampled_from([40, 9000]), style=st.sampled_from(["interleaved", "neox"]),
       scaled=st.booleans(), nt=threads, vw=widths)
@settings(deadline=None, max_examples=60)
def test_rope_positions(T, hd, heads, top, style, scaled, nt, vw):
    n = hd * heads
    x = rng.standard_normal((T, n)).astype(np.float32)
    positions = rng.integers(0, top, T).astype(np.int32)
    attrs = dict(head_dim=hd, theta=10000.0, style=style)
    if scaled:
        attrs.update(freq_scale=0.25, ext_factor=1.0, yarn_orig_ctx=512, attn_factor=1.25)
    sig = sig_for("rope", [f32("T", n), i32("T")], **attrs)
    got = run(sig, [x, positions], T=T, nthreads=nt, vw=vw)
    want = ops.rope_ref(x, positions, **attrs)
    close(got, want, rtol=0, atol=1e-5)
    # row by row, the scalar form's answer at that position
    for r in range(T):
        np.testing.assert_array_equal(want[r], ops.rope_ref(x[r: r + 1], int(positions[r]), **attrs)[0])


# --- references and shape rules ---------------------------------------------------------
def test_paged_references_refuse_bad_tables():
    b = make_batch([5, 3], [1, 1], 2, False)
    kc = pool("f32", b, 8)
    q = np.zeros((2, 8), np.float32)
    attrs = dict(n_heads=1, n_kv_heads=1, head_dim=8, scale=1.0, block_size=2)
    ops.attention_paged_ref(q, kc, kc, b.positions, b.tables, **attrs)
    for bad_pos, bad_tab in ((np.array([-1, 0]), b.tables), (np.array([2 * b.tables.shape[1], 0]), b.tables)):
        with pytest.raises(IndexError, match="position"):
            ops.attention_paged_ref(q, kc, kc, bad_pos, bad_tab, **attrs)
    tab = b.tables.copy()
    tab[0, 0] = b.n_blocks
    with pytest.raises(IndexError, match="pool"):
        ops.kv_write_paged_ref(kc, q, b.positions, tab, block_size=2)
    tab[0, 0] = -1
    with pytest.raises(IndexError, match="pool"):
        ops.attention_paged_ref(q, kc, kc, b.positions, tab, **attrs)


def test_paged_shape_rules():
    ct = kv_cache_type("f32", 32, 16)
    attrs = dict(n_heads=2, n_kv_heads=1, head_dim=16, scale=0.25, window=0, block_size=8)
    t = ops.get_op("attention_paged").infer([f32("T", 32), ct, ct, i32("T"), i32("T", 4)], attrs)
    assert t == f32("T", 32)
    assert ops.get_op("kv_write_paged").infer([ct, f32("T", 16), i32("T"), i32("T", 4)], {"block_size": 8}) == ct
    with pytest.raises(ops.ShapeError, match="whole blocks"):
        ops.get_op("kv_write_paged").infer([ct, f32("T", 16), i32("T"), i32("T", 4)], {"block_size": 5})
    with pytest.raises(ops.ShapeError, match="positions"):
        ops.get_op("kv_write_paged").infer([ct, f32("T", 16), i32(), i32("T", 4)], {"block_size": 8})
    with pytest.raises(ops.ShapeError, match="block tables"):
        ops.get_op("attention_paged").infer([f32("T", 32), ct, ct, i32("T"), i32(4)], attrs)
    with pytest.raises(ops.ShapeError, match="position per row"):
        ops.get_op("rope").infer([f32("T", 32), i32(3)], dict(head_dim=16, theta=1e4, style="neox"))
    assert ops.get_op("rope").infer([f32("T", 32), i32("T")], dict(head_dim=16, theta=1e4, style="neox")) == \
        f32("T", 32)
    with pytest.raises(ops.ShapeError):
        ops.get_op("attention_paged").infer([f32(32), ct, ct, i32("T"), i32("T", 4)], attrs)
    assert TensorType(("T", 4), "i32").rank == 2
