"""The kernel cache: one compiled object per kernel, shared by every model.

A kernel is specialised on its signature (op, operand types, attributes);
its object code depends on nothing else but the target, the vector width,
the optimisation level and the code generator itself. Keyed by exactly
those, a kernel compiled for one model (or one context length, or one
pass list) is reused by every other graph that needs it, so a second model
of a family compiles only the kernels it does not share.

Each entry is one file, ``kernels/<key>.o``: a magic, the key, a SHA-256 of
key and code, then the object code. It is written to a private temporary
name and renamed into place, so concurrent processes filling the cache
never see half a file; an entry that fails its checks is removed and
compiled again, never linked.
"""
from __future__ import annotations

import json
import os
from typing import Any

from frontends.cache_dir import write_entry
from ir.digest import sha256

from .cache import cache_dir

MAGIC = b"LMCKOBJ1"
_KEY_LEN = 32
_HEAD = len(MAGIC) + _KEY_LEN + 32


def kernel_dir() -> str:
    return os.path.join(cache_dir(), "kernels")


def kernel_key(parts: dict[str, Any]) -> str:
    """A key from what determines a kernel's code (the caller lists it:
    signature, target, vector width, optimisation level, code generator)."""
    return sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:_KEY_LEN]


def entry_path(key: str) -> str:
    return os.path.join(kernel_dir(), f"{key}.o")


def encode(key: str, obj: bytes) -> bytes:
    k = key.encode("ascii")
    return MAGIC + k + sha256(k + obj).digest() + obj


def decode(key: str, data: bytes) -> bytes | None:
    """The object code of an entry, or None if it is not intact: wrong
    magic, another key, truncated or altered."""
    k = key.encode("ascii")
    if len(data) <= _HEAD or data[: len(MAGIC)] != MAGIC or data[len(MAGIC): len(MAGIC) + _KEY_LEN] != k:
        return None
    digest, obj = data[len(MAGIC) + _KEY_LEN: _HEAD], data[_HEAD:]
    return obj if sha256(k + obj).digest() == digest else None


def load(key: str) -> tuple[bytes | None, bool]:
    """``(object code, False)`` on a hit, ``(None, False)`` on a miss and
    ``(None, True)`` when the entry was damaged (it is removed)."""
    path = entry_path(key)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None, False
    obj = decode(key, data)
    if obj is None:
        try:
            os.remove(path)
        except OSError:
            pass
        return None, True
    return obj, False


def store(key: str, obj: bytes) -> bool:
    """Best effort and atomic: a failed write only costs a compile next time."""
    return write_entry(entry_path(key), encode(key, obj))
