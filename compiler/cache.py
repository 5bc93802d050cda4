"""The compile cache: artifacts on disk, keyed by what determines the code.

The key hashes the planned graphs' text (shapes, weight offsets, ops), the
compile options, the CPU name and features and the lmc/LLVM versions, so a
warm start finds its object code without invoking LLVM. A corrupt entry is
reported, removed and rebuilt, never trusted.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any

from frontends.cache_dir import cache_root
from ir.digest import sha256

from .artifact import Artifact, ArtifactError


def cache_dir() -> str:
    return cache_root()


def cache_key(parts: dict[str, Any]) -> str:
    return sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def cache_path(key: str) -> str:
    return os.path.join(cache_dir(), f"{key}.lmca")


def lookup(key: str) -> Artifact | None:
    path = cache_path(key)
    if not os.path.exists(path):
        return None
    try:
        return Artifact.read(path)
    except ArtifactError as e:
        print(f"lmc: warning: {e}; rebuilding it", file=sys.stderr)
        try:
            os.remove(path)
        except OSError:
            pass
        return None


def store(key: str, art: Artifact) -> str | None:
    """Best effort: an unwritable cache only costs a recompile next time."""
    path = cache_path(key)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        art.write(path)
        return path
    except OSError as e:
        print(f"lmc: warning: cannot write the compile cache ({e.strerror}: {path})", file=sys.stderr)
        return None
