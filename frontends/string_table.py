"""Large string arrays without a Python object per string.

A vocabulary of 262144 pieces held as ``list[str]`` plus a ``dict[str, int]``
costs ~45 MB of Python objects; as one byte blob, an offsets array and an
open-addressing hash table in numpy it costs ~9 MB, which matters when the
whole process must fit a memory budget of 100 MB. ``StringArray`` is the
blob; ``StringIndex`` finds a string's (lowest) index in it, at a few hundred
nanoseconds a lookup (a dict takes ~60 ns): a crc32 and one or two probes.
"""
from __future__ import annotations

from typing import Iterable, Iterator, Sequence
from zlib import crc32

import numpy as np

#: an empty slot of a StringIndex table (a full slot: crc32 << 32 | id)
_EMPTY = np.uint64(2**64 - 1)
_EMPTY_INT = 2**64 - 1
#: names the hash and table layout, for tables stored on disk
INDEX_SCHEME = "crc32;mod-prime;linear;v1"


class StringArray(Sequence):
    """Byte strings stored back to back: ``blob[offsets[i]:offsets[i+1]]``."""

    __slots__ = ("blob", "offsets", "_off", "_index")

    def __init__(self, blob: bytes, offsets: np.ndarray) -> None:
        offsets = np.ascontiguousarray(offsets, dtype=np.int64)
        if offsets.ndim != 1 or offsets.size < 1 or offsets[0] != 0 or offsets[-1] != len(blob) \
                or (offsets.size > 1 and np.any(np.diff(offsets) < 0)):
            raise ValueError("string array offsets do not fit the blob")
        self.blob = bytes(blob)
        self.offsets = offsets
        self._off = memoryview(offsets)   # scalar reads at list speed, no copy
        self._index: StringIndex | None = None

    @classmethod
    def from_list(cls, items: Iterable[bytes]) -> "StringArray":
        items = [bytes(b) for b in items]
        offsets = np.zeros(len(items) + 1, np.int64)
        np.cumsum(np.fromiter(map(len, items), np.int64, len(items)), out=offsets[1:])
        return cls(b"".join(items), offsets)

    @classmethod
    def from_lengths(cls, blob: bytes, lengths: np.ndarray) -> "StringArray":
        offsets = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return cls(blob, offsets)

    def index(self) -> "StringIndex":
        """The hash index of these strings, built on first use."""
        if self._index is None:
            self._index = StringIndex(self)
        return self._index

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return self.offsets.size - 1

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("string array index out of range")
        return self.blob[self._off[i]: self._off[i + 1]]

    def __iter__(self) -> Iterator[bytes]:
        blob, off = self.blob, self.offsets.tolist()
        for a, b in zip(off, off[1:]):
            yield blob[a:b]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StringArray):
            return self.blob == other.blob and np.array_equal(self.offsets, other.offsets)
        if isinstance(other, (list, tuple)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"StringArray({len(self)} strings, {len(self.blob)} bytes)"


def _next_prime(n: int) -> int:
    def prime(k: int) -> bool:
        if k < 2 or k % 2 == 0:
            return k == 2
        f = 3
        while f * f <= k:
            if k % f == 0:
                return False
            f += 2
        return True

    while not prime(n):
        n += 1
    return n


def _hashes(strings: StringArray) -> np.ndarray:
    """zlib.crc32 of every string (uint64)."""
    return np.fromiter(map(crc32, strings), np.uint64, len(strings))


class StringIndex:
    """str bytes -> lowest index i with ``strings[i] == key``; exact (every
    hit is checked against the blob)."""

    __slots__ = ("strings", "table", "_t", "_size", "_blob", "_off")

    def __init__(self, strings: StringArray, table: np.ndarray | None = None) -> None:
        """``table``: one built before (``self.table``, e.g. from a disk
        cache); it is checked against the strings, not rebuilt."""
        self.strings = strings
        self._blob, self._off = strings.blob, strings._off
        n = len(strings)
        size = _next_prime(max(7, 2 * n + 1))
        if table is not None:
            self._use(np.ascontiguousarray(table, dtype=np.uint64), size)
            table = self.table
            ids = (table[table != _EMPTY] & np.uint64(0xFFFFFFFF)).astype(np.int64)
            if table.shape != (size,) or ids.size != n or (n and int(ids.max()) >= n) \
                    or (n and int(np.bincount(ids, minlength=n).max()) != 1):
                raise ValueError("stored string index does not fit its strings")
            for j in np.linspace(0, n - 1, min(n, 64)).astype(np.int64).tolist():
                k = self.get(strings[j])
                if k is None or strings[k] != strings[j]:
                    raise ValueError("stored string index does not find its strings")
            return
        h = _hashes(strings)
        table = np.full(size, _EMPTY, np.uint64)
        # linear probing, inserted in rounds; within a round the lowest id
        # takes a contested free slot, so duplicates keep their first id
        pend = np.arange(n, dtype=np.int64)
        slot = (h % np.uint64(size)).astype(np.int64)
        while pend.size:
            s = slot[pend]
            free = table[s] == _EMPTY
            cand, cs = pend[free], s[free]
            u, first = np.unique(cs, return_index=True)   # cand ascends: first = lowest id
            win = cand[first]
            table[u] = (h[win] << np.uint64(32)) | win.astype(np.uint64)
            lost = np.ones(pend.size, bool)
            lost[np.flatnonzero(free)[first]] = False
            pend = pend[lost]
            slot[pend] += 1
            slot[pend[slot[pend] == size]] = 0
        self._use(table, size)

    def _use(self, table: np.ndarray, size: int) -> None:
        self.table, self._t, self._size = table, memoryview(table), size

    def get(self, key: bytes, default: int | None = None) -> int | None:
        h = crc32(key)
        size = self._size
        i = h % size
        t = self._t
        while True:
            e = t[i]
            if e == _EMPTY_INT:
                return default
            if e >> 32 == h:
                j = e & 0xFFFFFFFF
                off = self._off
                if self._blob[off[j]: off[j + 1]] == key:
                    return j
            i += 1
            if i == size:
                i = 0

    def __contains__(self, key: bytes) -> bool:
        return self.get(key) is not None

    def __getitem__(self, key: bytes) -> int:
        j = self.get(key)
        if j is None:
            raise KeyError(key)
        return j

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StringIndex):
            return NotImplemented
        return self.strings == other.strings

    __hash__ = None  # type: ignore[assignment]

    def __len__(self) -> int:
        return len(self.strings)
