"""The paged KV cache's block bookkeeping: tables, shared prefixes, copy on
write, eviction, and its invariants under any sequence of operations."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from runtime.engine.block_manager import BlockManager, OutOfBlocks, common_run, prefix_hashes


def check_invariants(bm: BlockManager) -> None:
    counts = [0] * bm.n_blocks
    for s in bm.seqs.values():
        for b in s.table:
            counts[b] += 1
        assert len(s.hashes) <= len(s.table)
    assert counts == bm.refs, "a block's reference count is the number of tables holding it"
    free, ev = set(bm.free), set(bm.evictable)
    assert len(free) == len(bm.free) and not free & ev
    for b in range(bm.n_blocks):
        in_use = bm.refs[b] > 0
        assert in_use + (b in free) + (b in ev) == 1, f"block {b} is in exactly one state"
    for b in ev:
        assert b in bm.hash_of, "an evictable block is a cached one"
    assert {bm.cached[h] for h in bm.cached} <= set(bm.hash_of)
    assert bm.available + sum(1 for r in bm.refs if r) == bm.n_blocks
    for s in bm.seqs.values():
        for src, dst in s.copies:
            assert src != dst and dst in s.table and src not in s.table
    for (_, start), b in bm.starts.items():
        assert b in bm.hash_of and 0 < len(start) < bm.block_size, "a start indexes a cached block"


def test_prompts_sharing_a_prefix_share_its_full_blocks():
    bm = BlockManager(16, 4)
    system = list(range(100, 110))                      # 2 full blocks + 2 tokens
    a_tokens = system + [1, 2, 3]
    a, cached = bm.allocate(1, a_tokens)
    assert cached == 0 and len(a) == 4
    bm.commit(1, a_tokens)                              # its prefill is done: full blocks are cached
    b, cached = bm.allocate(2, system + [7, 8])
    # two full blocks shared; the third starts as a's (108, 109): a private copy, 2 positions reused
    assert cached == 10 and b[:2] == a[:2] and b[2] != a[2]
    assert bm.copies(2) == [(a[2], b[2])] and bm.copies(2) == []
    assert bm.refs[a[0]] == bm.refs[a[1]] == 2 and bm.refs[a[2]] == 1
    check_invariants(bm)
    # the other sequence's tokens differ inside the second block: the first is shared, one position copied
    c, cached = bm.allocate(3, system[:5] + [0] * 5)
    assert cached == 5 and c[0] == a[0] and c[1] != a[1] and bm.copies(3) == [(a[1], c[1])]
    # nothing in common past the shared blocks: nothing to copy
    d, cached = bm.allocate(4, system[:4] + [0] * 5)
    assert cached == 4 and bm.copies(4) == []
    check_invariants(bm)


def test_hash_chains_tell_what_is_shared_and_what_is_cached():
    """``prefix_hashes`` of two prompts agree exactly on the full blocks with
    the same tokens so far; ``cached_run`` counts the leading ones committed."""
    bm = BlockManager(16, 4)
    a = list(range(1, 15))                       # 3 full blocks and 2 tokens
    b = a[:9] + [99] + a[10:]                    # differs in block 2
    ha, hb = prefix_hashes(a, 4), prefix_hashes(b, 4)
    assert len(ha) == 3 and common_run(ha, hb) == 2
    assert common_run(prefix_hashes([7] + a[1:], 4), ha) == 0   # a block's hash covers all before it
    assert bm.cached_run(ha) == 0
    bm.allocate(1, a)
    bm.commit(1, a[:8])                          # two blocks computed
    assert bm.cached_run(ha) == 2 and bm.cached_run(hb) == 2
    bm.commit(1, a)
    assert bm.cached_run(ha) == 3 and bm.cached_run(hb) == 2
    assert bm.allocate(2, b)[1] == 2 * 4 + 1     # allocate agrees (and copies the first token of block 2)


def test_a_partial_match_is_the_longest_and_never_its_own_copy():
    bm = BlockManager(4, 4)
    for seq, toks in ((1, [1, 2, 3, 4]), (2, [1, 2, 9, 9])):
        bm.allocate(seq, toks)
        bm.commit(seq, toks)
        bm.release(seq)
    assert len(bm.evictable) == 2 and len(bm.free) == 2
    # the longest start wins (3 of [1, 2, 3, 4]); the source, evictable, is not taken for the copy
    t, cached = bm.allocate(3, [1, 2, 3, 7, 7, 7, 7, 7, 7])
    (src, dst), = bm.copies(3)
    assert cached == 3 and dst == t[0] and src != dst and src not in t
    check_invariants(bm)
    bm.release(3)
    # when keeping the source would leave too few blocks, the positions are computed instead
    bm2 = BlockManager(2, 4)
    bm2.allocate(1, [1, 2, 3, 4])
    bm2.commit(1, [1, 2, 3, 4])
    bm2.release(1)
    t, cached = bm2.allocate(2, [1, 2, 3, 5, 6, 7, 8, 9])
    assert cached == 0 and bm2.copies(2) == [] and len(t) == 2
    check_invariants(bm2)


def test_writing_into_a_shared_block_copies_it_first():
    bm = BlockManager(8, 4)
    toks = [5, 6, 7, 8]
    t1, _ = bm.allocate(1, toks)
    bm.commit(1, toks)
    t2, cached = bm.allocate(2, toks)                   # the whole prompt is cached
    assert cached == 4 and t2 == t1
    # sequence 2 must recompute its last token (for logits): position 3 is in the shared block
    copies = bm.ensure(2, 3)
    assert copies == [(t1[0], bm.table(2)[0])] and bm.table(2)[0] != t1[0]
    assert bm.refs[t1[0]] == 1
    assert bm.ensure(2, 4) == [] and len(bm.table(2)) == 2   # a new block for the next position
    check_invariants(bm)


def test_finished_sequences_leave_their_prefix_cached_until_room_is_needed():
    bm = BlockManager(4, 2)
    toks = [1, 2, 3, 4, 5]
    t, _ = bm.allocate(1, toks)
    bm.commit(1, toks)
    bm.release(1)
    assert bm.available == 4 and len(bm.evictable) == 2     # two full blocks stay cached
    t2, cached = bm.allocate(2, [1, 2, 3, 4, 9])
    assert cached == 4 and t2[:2] == t[:2]
    bm.release(2)
    big, cached = bm.allocate(3, list(range(50, 58)))        # needs all 4 blocks: the cached ones are evicted
    assert cached == 0 and sorted(big) == [0, 1, 2, 3] and not bm.cached
    with pytest.raises(OutOfBlocks):
        bm.allocate(4, [1])
    assert 4 not in bm.seqs
    check_invariants(bm)


def test_running_out_of_blocks_changes_nothing():
    bm = BlockManager(3, 2)
    bm.allocate(1, [1, 2, 3, 4])

    def state():
        return list(bm.refs), list(bm.free), {k: list(v.table) for k, v in bm.seqs.items()}

    before = state()
    with pytest.raises(OutOfBlocks):
        bm.allocate(2, [1, 2, 3, 4, 5, 6])
    assert state() == before
    bm.ensure(1, 4)
    before = state()
    with pytest.raises(OutOfBlocks):
        bm.ensure(1, 6)
    assert state() == before and len(bm.table(1)) == 3
    check_invariants(bm)


@given(st.lists(st.tuples(st.sampled_from(["alloc", "grow", "commit", "release"]), st.integers(0, 5),
                          st.integers(0, 3), st.integers(1, 9)), max_size=60))
@settings(max_examples=200, deadline=None)
def test_invariants_hold_under_any_operations(ops):
    bm = BlockManager(12, 3)
    tokens: dict[int, list[int]] = {}
    for op, seq, family, n in ops:
        try:
            if op == "alloc" and seq not in tokens:
                toks = [family * 1000 + i for i in range(n)]       # sequences of a family share prefixes
                bm.allocate(seq, toks)
                tokens[seq] = toks
            elif op == "grow" and seq in tokens:
                toks = tokens[seq]
                for src, dst in bm.ensure(seq, len(toks)):
                    assert bm.refs[dst] == 1 and src != dst
                toks.append(family * 1000 + len(toks))
            elif op == "commit" and seq in tokens:
                bm.commit(seq, tokens[seq])
            elif op == "release" and seq in tokens:
                bm.release(seq)
                del tokens[seq]
        except OutOfBlocks:
            pass
        check_invariants(bm)
        for s, toks in tokens.items():
            assert len(bm.table(s)) >= bm.blocks_for(len(toks))
