"""StringArray / StringIndex: a vocabulary without a Python object per piece."""
from __future__ import annotations

import random

import numpy as np
import pytest

from frontends.string_table import StringArray, StringIndex


def _words(n: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    alphabet = ["a", "b", "c", "\u2581", "é", "日", "🦙", "\x00", " "]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6))).encode() for _ in range(n)]


def test_array_is_a_sequence_of_bytes():
    items = [b"", b"ab", b"\x00", "日本".encode()]
    a = StringArray.from_list(items)
    assert len(a) == 4 and list(a) == items and a[-1] == items[-1] and a[1:3] == items[1:3]
    assert a == items and a == StringArray.from_list(items) and a != StringArray.from_list(items[:3])
    with pytest.raises(IndexError):
        a[4]
    with pytest.raises(ValueError):
        StringArray(b"abc", np.array([0, 2]))


def test_index_finds_the_lowest_id_like_a_dict():
    items = _words(5000) + [b"", b"\x00a", b"a", b"\x00a", b"zz"]
    ix = StringIndex(StringArray.from_list(items))
    want: dict[bytes, int] = {}
    for i, w in enumerate(items):
        want.setdefault(w, i)
    assert all(ix.get(w) == i for w, i in want.items())
    for miss in (b"not there", b"\x00\x00\x00a", "\u2581\u2581\u2581\u2581\u2581\u2581\u2581".encode()):
        assert ix.get(miss) is None and miss not in ix
    assert ix.get(b"nope", -1) == -1


def test_stored_table_is_checked():
    a = StringArray.from_list(_words(300))
    table = StringIndex(a).table
    again = StringIndex(a, table.copy())
    assert all(again.get(w) == StringIndex(a).get(w) for w in a)
    with pytest.raises(ValueError):
        StringIndex(a, table[:-1])
    with pytest.raises(ValueError):   # every id once, but not where the hashes say
        StringIndex(a, table[::-1].copy())
