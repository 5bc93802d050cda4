"""Which cached artifact a model and its options compile to, remembered.

The compile cache's key hashes the planned graphs, so finding a cached
artifact means building the graphs, running the passes and planning the
arena: ~0.1-0.2 s of a warm start that otherwise only maps code and
weights. This memo maps what the plan is a function of (the model's config
and weight references, the model file's identity, the compile options, the
target, the CPU count a budget plans threads for, and the source of the
frontends, passes, IR and code generator) to the artifact key that plan
gave. Any change to those is another memo key, so a stale memo can only
miss; an entry that cannot be read is a miss.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
from typing import Any

from frontends.cache_dir import write_entry
from ir.digest import sha256

from .cache import cache_dir
from .host_cores import usable_cores

#: NativeOptions fields that do not change the plan or the code
_NOT_PLAN = ("use_cache", "lookup_only", "progress", "jobs", "dump_dir", "dump_after")


@functools.cache
def frontends_fingerprint() -> str:
    """The graphs come from the frontends' architecture table."""
    h = sha256()
    here = pathlib.Path(__file__).resolve().parent.parent / "frontends"
    for f in sorted(here.glob("*.py")):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:16]


def memo_key(model: Any, options: Any, parts: dict[str, Any]) -> str | None:
    """The memo key of compiling ``model`` (a LoadedModel) with ``options``
    (NativeOptions); ``parts`` adds the caller's own (target, versions,
    code generator). None when the model file cannot be stat'ed."""
    try:
        st = os.stat(model.path)
    except OSError:
        return None
    weights = sha256()
    for name in sorted(model.weights):
        w = model.weights[name]
        weights.update(repr((name, w.type, dataclasses.astuple(w.ref))).encode())
    opts = {f.name: getattr(options, f.name) for f in dataclasses.fields(options) if f.name not in _NOT_PLAN}
    koff = getattr(model, "key_offsets", None)
    what = {
        "file": [os.path.abspath(model.path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns],
        "format": model.format,
        "config": repr(model.config),
        "weights": weights.hexdigest(),
        "key_offsets": None if koff is None else sha256(koff.tobytes()).hexdigest(),
        "options": repr(opts),
        "cpus": usable_cores(),
        "frontends": frontends_fingerprint(),
        **parts,
    }
    return sha256(json.dumps(what, sort_keys=True, default=repr).encode()).hexdigest()[:32]


def _path(key: str) -> str:
    return os.path.join(cache_dir(), "memo", f"{key}.json")


def recall(key: str) -> str | None:
    """The artifact key remembered for ``key``, if any."""
    try:
        with open(_path(key), encoding="utf-8") as f:
            v = json.load(f).get("artifact")
    except (OSError, ValueError, AttributeError):
        return None
    return v if isinstance(v, str) and len(v) == 32 and all(c in "0123456789abcdef" for c in v) else None


def remember(key: str, artifact_key: str) -> None:
    """Best effort and atomic."""
    write_entry(_path(key), json.dumps({"artifact": artifact_key}).encode())
