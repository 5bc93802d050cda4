"""A disk cache of what ``gguf.GGUFReader`` found in a file.

Stored as one ``.npz`` (no pickle): numeric arrays as arrays, string arrays
as one byte blob plus offsets, everything else as JSON. Keyed by the file's
absolute path, size and modification time, so an edited or replaced file is
read again. Any problem with an entry means a cache miss, never an error.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
from typing import Any

import numpy as np

FORMAT = 1


def _dir() -> str:
    d = os.environ.get("LMC_CACHE_DIR")
    if not d:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        d = os.path.join(base, "lmc")
    return os.path.join(d, "gguf")


def _entry(path: str) -> str:
    st = os.stat(path)
    key = json.dumps([os.path.abspath(path), st.st_size, st.st_mtime_ns, FORMAT])
    return os.path.join(_dir(), hashlib.sha256(key.encode()).hexdigest()[:32] + ".npz")


def store(path: str, meta: dict[str, Any], tensors: list) -> None:
    arrays: dict[str, np.ndarray] = {}
    plain: dict[str, Any] = {}
    for i, (k, v) in enumerate(meta.items()):
        if isinstance(v, np.ndarray):
            arrays[f"a{i}"] = v
            plain[k] = {"array": f"a{i}"}
        elif isinstance(v, list) and v and isinstance(v[0], bytes):
            lens = np.fromiter((len(b) for b in v), np.int64, len(v))
            arrays[f"b{i}"] = np.frombuffer(b"".join(v), np.uint8)
            arrays[f"o{i}"] = lens
            plain[k] = {"strings": i}
        elif isinstance(v, bytes):
            plain[k] = {"bytes": v.hex()}
        else:
            plain[k] = {"value": v}
    arrays["json"] = np.frombuffer(json.dumps({"meta": plain, "tensors": tensors}).encode(), np.uint8)
    try:
        os.makedirs(_dir(), exist_ok=True)
        entry = _entry(path)
        tmp = f"{entry}.{os.getpid()}.part"
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, entry)
    except (OSError, TypeError, ValueError):
        pass  # an unwritable cache only costs a slow read next time


def load(path: str) -> tuple[dict[str, Any], list] | None:
    try:
        with open(_entry(path), "rb") as f:
            data = f.read()
        z = np.load(io.BytesIO(data), allow_pickle=False)
        doc = json.loads(bytes(z["json"]).decode())
        meta: dict[str, Any] = {}
        for k, d in doc["meta"].items():
            if "array" in d:
                meta[k] = z[d["array"]]
            elif "strings" in d:
                i = d["strings"]
                blob = bytes(z[f"b{i}"])
                ends = np.cumsum(z[f"o{i}"])
                starts = ends - z[f"o{i}"]
                meta[k] = [blob[a:b] for a, b in zip(starts.tolist(), ends.tolist())]
            elif "bytes" in d:
                meta[k] = bytes.fromhex(d["bytes"])
            else:
                meta[k] = d["value"]
        return meta, doc["tensors"]
    except (OSError, KeyError, ValueError, TypeError):
        return None
