"""A disk cache of what ``gguf.GGUFReader`` found in a file.

Stored as one ``.npz`` (no pickle): numeric arrays as arrays, string arrays
as one byte blob plus lengths and their hash index (``StringIndex.table``),
everything else as JSON. String arrays load as ``StringArray``s, not one
Python object per string: Gemma's 262144 pieces cost ~9 MB, not ~60 MB, and
the index needs no rebuilding. Keyed by the file's absolute path, size and
modification time, so an edited or replaced file is read again. Any problem
with an entry means a cache miss, never an error.
"""
from __future__ import annotations

import io
import json
import os
import zipfile
from typing import Any

import numpy as np

from ir.digest import sha256

from .cache_dir import cache_root
from .string_table import INDEX_SCHEME, StringArray, StringIndex

FORMAT = 2


def _dir() -> str:
    return os.path.join(cache_root(), "gguf")


def _entry(path: str) -> str:
    st = os.stat(path)
    key = json.dumps([os.path.abspath(path), st.st_size, st.st_mtime_ns, FORMAT])
    return os.path.join(_dir(), sha256(key.encode()).hexdigest()[:32] + ".npz")


def _arrays(meta: dict[str, Any], tensors: list) -> dict[str, np.ndarray]:
    arrays: dict[str, np.ndarray] = {}
    plain: dict[str, Any] = {}
    for i, (k, v) in enumerate(meta.items()):
        if isinstance(v, np.ndarray):
            arrays[f"a{i}"] = v
            plain[k] = {"array": f"a{i}"}
        elif isinstance(v, StringArray) or (isinstance(v, list) and v and isinstance(v[0], bytes)):
            sa = v if isinstance(v, StringArray) else StringArray.from_list(v)
            arrays[f"b{i}"] = np.frombuffer(sa.blob, np.uint8)
            arrays[f"o{i}"] = sa.lengths()
            arrays[f"x{i}"] = sa.index().table
            plain[k] = {"strings": i, "index": INDEX_SCHEME}
        elif isinstance(v, bytes):
            plain[k] = {"bytes": v.hex()}
        else:
            plain[k] = {"value": v}
    arrays["json"] = np.frombuffer(json.dumps({"meta": plain, "tensors": tensors}).encode(), np.uint8)
    return arrays


def store(path: str, meta: dict[str, Any], tensors: list) -> None:
    arrays = _arrays(meta, tensors)
    try:
        os.makedirs(_dir(), exist_ok=True)
        entry = _entry(path)
        tmp = f"{entry}.{os.getpid()}.part"
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, entry)
    except (OSError, TypeError, ValueError):
        pass  # an unwritable cache only costs a slow read next time


def meta_to_bytes(meta: dict[str, Any]) -> bytes:
    """Metadata in this cache's format, as bytes (QSF files carry their
    GGUF-style tokenizer this way)."""
    buf = io.BytesIO()
    np.savez(buf, **_arrays(meta, []))
    return buf.getvalue()


def meta_from_file(f: Any) -> dict[str, Any]:
    """The inverse of ``meta_to_bytes``, read from a binary file positioned
    at the blob, which must end at the end of the file (a zip archive may
    have other data before it): members are read one at a time, the blob
    never whole. ValueError if it is not one."""
    try:
        with np.load(f, allow_pickle=False) as z:
            return _load(z)[0]
    except (OSError, KeyError, ValueError, TypeError, EOFError, zipfile.BadZipFile) as e:
        raise ValueError(f"not a metadata blob ({type(e).__name__})") from None


def is_cached(path: str) -> bool:
    """Whether this file version's metadata was read before (a load will be fast)."""
    try:
        return os.path.exists(_entry(path))
    except OSError:
        return False


def load(path: str) -> tuple[dict[str, Any], list] | None:
    try:
        with np.load(_entry(path), allow_pickle=False) as z:
            return _load(z)
    except (OSError, KeyError, ValueError, TypeError, EOFError, zipfile.BadZipFile):
        return None


def _load(z: Any) -> tuple[dict[str, Any], list]:
    doc = json.loads(z["json"].tobytes().decode())
    meta: dict[str, Any] = {}
    for k, d in doc["meta"].items():
        if "array" in d:
            meta[k] = z[d["array"]]
        elif "strings" in d:
            i = d["strings"]
            lens = z[f"o{i}"]
            if lens.dtype.kind not in "iu" or lens.ndim != 1 or (lens.size and lens.min() < 0):
                raise ValueError("bad string lengths")
            sa = StringArray.from_lengths(z[f"b{i}"].tobytes(), lens)
            if d.get("index") == INDEX_SCHEME and f"x{i}" in z.files:
                sa._index = StringIndex(sa, z[f"x{i}"])
            meta[k] = sa
        elif "bytes" in d:
            meta[k] = bytes.fromhex(d["bytes"])
        else:
            meta[k] = d["value"]
    return meta, doc["tensors"]
