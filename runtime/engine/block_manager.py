"""The paged KV cache's bookkeeping: which pool blocks each sequence owns.

The pool is the executor's (one block of ``block_size`` positions = that
many rows in every layer's K and V caches); this module only hands out block
numbers. As in vLLM's block manager:

* a sequence owns a block table: its positions 0, 1, ... live in table[0],
  table[1], ... (``block_size`` positions each), so one request may use the
  whole pool while many short ones share it;
* a full block is content-addressed by the hash of every token up to its
  end, so sequences whose prompts share a prefix (the same system prompt)
  share those blocks (reference counts), and the prefix is prefilled once;
* past the last full block they share, a prompt that starts like a cached
  block (same tokens before it, same first r) gets a private copy of that
  block and its first r positions are not computed again (``copies``): a
  system prompt rarely ends on a block boundary, and the block after it
  holds its end (as SGLang's radix cache shares to the token; vLLM shares
  full blocks only);
* a finished sequence's full blocks stay cached (evictable, least recently
  used first) until their room is needed;
* a shared block is never written: a sequence about to write into one gets
  a private copy first (copy on write; the caller copies the rows).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence


class OutOfBlocks(Exception):
    """No free or evictable block: the caller waits or preempts."""


@dataclass
class SeqBlocks:
    """One sequence's blocks: its table and the hashes of its full blocks."""

    table: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)   # of table[i] for each full block i, in order
    copies: list[tuple[int, int]] = field(default_factory=list)   # (src, dst) to make before its prefill
    #: leading table entries given back (``slide``): a window has passed them; their numbers stay
    #: in the table (never read) so positions keep their blocks' indices
    slid: int = 0


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """A full block's identity: its tokens and everything before them."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in tokens))
    return h.digest()


def prefix_hashes(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """The hashes of the full blocks of ``tokens``, in order (each one's
    parent is the one before)."""
    out: list[bytes] = []
    parent = b""
    for i in range(len(tokens) // block_size):
        parent = block_hash(parent, tokens[i * block_size: (i + 1) * block_size])
        out.append(parent)
    return out


def common_run(a: Sequence[bytes], b: Sequence[bytes]) -> int:
    """How many leading block hashes two chains share (equal hashes: equal
    tokens up to the end of that block)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class BlockManager:
    def __init__(self, n_blocks: int, block_size: int) -> None:
        if n_blocks < 1 or block_size < 1:
            raise ValueError("a pool needs at least one block of at least one position")
        self.n_blocks, self.block_size = n_blocks, block_size
        self.refs = [0] * n_blocks
        self.free: list[int] = list(range(n_blocks - 1, -1, -1))   # pop() gives 0, 1, ...
        self.cached: dict[bytes, int] = {}                          # full-block hash -> block
        self.hash_of: dict[int, bytes] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()       # cached blocks no sequence uses, LRU first
        self.seqs: dict[int, SeqBlocks] = {}
        #: (parent hash, first r tokens) -> a cached block that starts so, for r < block_size
        self.starts: dict[tuple[bytes, tuple[int, ...]], int] = {}
        self.starts_of: dict[int, list[tuple[bytes, tuple[int, ...]]]] = {}
        #: bumped whenever ``cached`` gains or loses a block (a replica republishes its hashes then)
        self.version = 0

    # --- counts ----------------------------------------------------------------------------
    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    @property
    def available(self) -> int:
        """Blocks a new allocation can take (free, or cached but unused)."""
        return len(self.free) + len(self.evictable)

    @property
    def used(self) -> int:
        return self.n_blocks - self.available

    def cached_run(self, hashes: Sequence[bytes]) -> int:
        """How many of these leading full blocks (``prefix_hashes``) the pool holds."""
        n = 0
        for h in hashes:
            if h not in self.cached:
                break
            n += 1
        return n

    # --- a sequence's life -----------------------------------------------------------------
    def allocate(self, seq: int, tokens: Sequence[int],
                 chain: Sequence[bytes] | None = None) -> tuple[list[int], int]:
        """Blocks for a new sequence whose prompt is ``tokens``: the longest
        run of full blocks already cached is shared, the rest is new.
        ``chain``: ``prefix_hashes(tokens)``, if the caller has it.
        Returns (table, tokens already in the pool). Raises OutOfBlocks
        (taking nothing) when the rest does not fit."""
        if seq in self.seqs:
            raise ValueError(f"sequence {seq} already has blocks")
        bs = self.block_size
        if chain is None:
            chain = prefix_hashes(tokens, bs)
        hashes = list(chain[: self.cached_run(chain)])     # the shared blocks'
        shared = [self.cached[h] for h in hashes]
        parent = hashes[-1] if hashes else b""
        need = self.blocks_for(len(tokens)) - len(shared)
        # a shared block that is evictable now is taken by this allocation, not available for the rest
        spare = self.available - sum(1 for b in shared if b in self.evictable)
        if need > spare:
            raise OutOfBlocks(f"{need} blocks needed, {spare} available")
        src, r = self._partial(parent, tokens[len(shared) * bs:])
        if src is not None and src in self.evictable and need > spare - 1:
            src, r = None, 0     # kept from eviction it would leave too few: compute those positions
        for b in shared:
            self._ref(b)
        if src is not None:
            self._ref(src)       # not evicted by this allocation's own takes before it is copied
        table = shared + [self._take() for _ in range(need)]
        self.seqs[seq] = SeqBlocks(table, hashes, [(src, table[len(shared)])] if src is not None else [])
        if src is not None:
            self._unref(src)
        return list(table), len(shared) * bs + r

    def _partial(self, parent: bytes, rest: Sequence[int]) -> tuple[int | None, int]:
        """A cached block whose first r tokens (the most, below a block) are
        the first r of ``rest`` after the same prefix, and r; else (None, 0)."""
        for r in range(min(self.block_size - 1, len(rest)), 0, -1):
            b = self.starts.get((parent, tuple(int(t) for t in rest[:r])))
            if b is not None:
                return b, r
        return None, 0

    def copies(self, seq: int) -> list[tuple[int, int]]:
        """The (src, dst) block copies ``allocate`` chose for ``seq`` (a
        cached block's first positions reused), taken once: the caller makes
        them before the sequence's prefill writes into dst."""
        s = self.seqs[seq]
        out, s.copies = s.copies, []
        return out

    def ensure(self, seq: int, pos: int) -> list[tuple[int, int]]:
        """Make position ``pos`` of ``seq`` writable: a new block when it
        starts one, a private copy of a shared block it falls in. Returns
        the (src, dst) block copies the caller must make before writing.
        Raises OutOfBlocks (changing nothing) when no block is left."""
        s = self.seqs[seq]
        i = pos // self.block_size
        if i > len(s.table):
            raise ValueError(f"sequence {seq}: position {pos} skips a block")
        if i == len(s.table):
            s.table.append(self._take())
            return []
        b = s.table[i]
        if self.refs[b] > 1:   # shared: copy on write
            nb = self._take()
            self._unref(b)
            s.table[i] = nb
            del s.hashes[i:]
            return [(b, nb)]
        if b in self.hash_of:   # cached for others, and about to change: it no longer holds that content
            self._uncache(b)
            del s.hashes[i:]
        return []

    def commit(self, seq: int, tokens: Sequence[int]) -> None:
        """``tokens`` (the sequence from position 0) are now in the pool:
        cache each full block not cached yet, so later prompts can share it."""
        s = self.seqs[seq]
        bs = self.block_size
        for i in range(len(s.hashes), min(len(tokens) // bs, len(s.table))):
            parent = s.hashes[-1] if s.hashes else b""
            h = block_hash(parent, tokens[i * bs: (i + 1) * bs])
            s.hashes.append(h)
            b = s.table[i]
            if h not in self.cached and b not in self.hash_of:
                self.cached[h] = b
                self.hash_of[b] = h
                self.version += 1
                block = tuple(int(t) for t in tokens[i * bs: (i + 1) * bs])
                keys = [(parent, block[:r]) for r in range(1, bs)]
                for k in keys:
                    self.starts[k] = b
                self.starts_of[b] = keys

    def release(self, seq: int) -> None:
        """The sequence is done: its blocks go back (cached ones stay cached)."""
        s = self.seqs.pop(seq)
        for b in s.table[s.slid:]:
            self._unref(b)

    def slide(self, seq: int, first_needed: int) -> int:
        """Give back the blocks of ``seq`` that lie wholly before position
        ``first_needed`` (a sliding window has passed them: no later step
        reads them). Cached ones stay cached, as a finished sequence's do.
        Returns how many blocks went back."""
        s = self.seqs[seq]
        # committed blocks only: ``commit`` hashes a block by its table entry, never a given-back one
        n = min(max(0, first_needed) // self.block_size, len(s.hashes))
        gone = 0
        while s.slid < n:
            self._unref(s.table[s.slid])
            s.slid += 1
            gone += 1
        return gone

    def table(self, seq: int) -> list[int]:
        return self.seqs[seq].table

    # --- blocks ----------------------------------------------------------------------------
    def _take(self) -> int:
        if self.free:
            b = self.free.pop()
        elif self.evictable:
            b, _ = self.evictable.popitem(last=False)
            self._uncache(b)
        else:
            raise OutOfBlocks("no block is free")
        self.refs[b] = 1
        return b

    def _ref(self, b: int) -> None:
        if self.refs[b] == 0:
            self.evictable.pop(b, None)
        self.refs[b] += 1

    def _unref(self, b: int) -> None:
        self.refs[b] -= 1
        if self.refs[b] == 0:
            if b in self.hash_of:
                self.evictable[b] = None
            else:
                self.free.append(b)

    def _uncache(self, b: int) -> None:
        h = self.hash_of.pop(b)
        if self.cached.get(h) == b:
            del self.cached[h]
            self.version += 1
        for k in self.starts_of.pop(b, ()):
            if self.starts.get(k) == b:
                del self.starts[k]
