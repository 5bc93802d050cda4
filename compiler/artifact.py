"""The compiled artifact: object code plus the manifest a runtime needs.

One file: magic ``LMCART1\\0``, the manifest (JSON) and the object code, each
with its length, and a SHA-256 of everything before it, so a truncated or
altered file is refused before anything in it is trusted. The object code
is one blob: since format 2 a pack of objects (``objpack``: the glue and
one object per kernel), before it a single object.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Any

from frontends.cache_dir import cache_root, write_entry
from frontends.output_file import write_atomic
from ir.digest import sha256

MAGIC = b"LMCART1\0"
#: 2: the object code is a pack of objects (``objpack``: glue and kernels);
#: format 1 (one object) still reads. 3: a repacked region names its base
#: layout and tile width apart (``repack``), not as one name ("Q5_0x16"),
#: which formats 1 and 2 did (``runtime.weight_image.regions`` reads both)
FORMAT_VERSION = 3
READS_VERSIONS = (1, 2, 3)


class ArtifactError(ValueError):
    """An artifact that cannot be used; the message names the file."""


@dataclass
class Artifact:
    manifest: dict[str, Any]
    obj: bytes

    def to_bytes(self) -> bytes:
        man = json.dumps(self.manifest, sort_keys=True).encode()
        body = MAGIC + struct.pack("<Q", len(man)) + man + struct.pack("<Q", len(self.obj)) + self.obj
        return body + sha256(body).digest()

    def write(self, path: str | os.PathLike) -> None:
        """Write atomically: a crash never leaves a half-written artifact."""
        path = os.fspath(path)
        try:
            write_atomic(path, self.to_bytes())
        except OSError as e:
            raise ArtifactError(f"{path}: cannot write the artifact ({e.strerror})") from None

    @classmethod
    def from_bytes(cls, data: bytes, name: str) -> "Artifact":
        if len(data) < len(MAGIC) + 8 + 8 + 32 or data[: len(MAGIC)] != MAGIC:
            raise ArtifactError(f"{name}: not an lmc artifact (bad magic or too short)")
        body, digest = data[:-32], data[-32:]
        if sha256(body).digest() != digest:
            raise ArtifactError(f"{name}: corrupt or truncated artifact (checksum mismatch)")
        p = len(MAGIC)
        (mlen,) = struct.unpack_from("<Q", body, p)
        p += 8
        if p + mlen + 8 > len(body):
            raise ArtifactError(f"{name}: corrupt artifact (manifest length)")
        try:
            manifest = json.loads(body[p: p + mlen])
        except ValueError:
            raise ArtifactError(f"{name}: corrupt artifact (manifest is not JSON)") from None
        p += mlen
        (olen,) = struct.unpack_from("<Q", body, p)
        p += 8
        if p + olen != len(body):
            raise ArtifactError(f"{name}: corrupt artifact (object code length)")
        if manifest.get("format_version") not in READS_VERSIONS:
            raise ArtifactError(f"{name}: artifact format {manifest.get('format_version')} "
                                f"(this lmc reads {FORMAT_VERSION})")
        return cls(manifest, body[p:])

    @classmethod
    def read(cls, path: str | os.PathLike) -> "Artifact":
        path = os.fspath(path)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise ArtifactError(f"{path}: cannot read: {e.strerror}") from None
        return cls.from_bytes(data, path)


def is_artifact(path: str | os.PathLike) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


#: files above this size are hashed on a sample: hashing all of a 253 MB
#: model costs a cold start ~0.4 s of CPU (it was 256 MiB until the
#: kernel cache made the rest of the compile that fast)
FULL_HASH_BYTES = 64 << 20
KINDS = ("sha256", "sha256-sampled")


def file_fingerprint(path: str, kind: str | None = None) -> dict[str, Any]:
    """Size and SHA-256 of a model file. Files over ``FULL_HASH_BYTES`` are
    hashed on a sample (the first and last MiB and 32 evenly spaced 64 KiB
    pieces); the size and sample still tell files apart. ``kind`` asks for
    one of ``KINDS`` whatever the size (checking an artifact that recorded
    it). The result is remembered in the compile cache, keyed by the file's
    path, inode, size and modification time, so loading an artifact does
    not read its model file through again."""
    st = os.stat(path)
    if kind not in KINDS:
        kind = "sha256" if st.st_size <= FULL_HASH_BYTES else "sha256-sampled"
    memo = _fingerprint_memo(path, st, kind)
    if memo is not None:
        try:
            with open(memo, encoding="utf-8") as f:
                fp = json.load(f)
            if isinstance(fp, dict) and fp.get("size") == st.st_size and len(fp) == 2 and kind in fp:
                return fp
        except (OSError, ValueError):
            pass
    fp = _hash_file(path, kind)
    if memo is not None:   # best effort: the next load hashes again
        write_entry(memo, json.dumps(fp).encode())
    return fp


def _fingerprint_memo(path: str, st: os.stat_result, kind: str) -> str | None:
    ident = json.dumps([os.path.abspath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns,
                        kind])
    return os.path.join(cache_root(), "fingerprints", sha256(ident.encode()).hexdigest()[:32] + ".json")


def sampled_digest(path: str) -> str:
    """SHA-256 of a file's sample (``sha256-sampled``: the first and last MiB
    and 32 evenly spaced 64 KiB pieces): a few milliseconds for any size."""
    return _hash_file(path, "sha256-sampled")["sha256-sampled"]


def _hash_file(path: str, kind: str = "sha256") -> dict[str, Any]:
    size = os.path.getsize(path)
    h = sha256()
    with open(path, "rb") as f:
        if kind == "sha256":
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        else:
            for off in [0, max(0, size - (1 << 20))] + [size * i // 33 for i in range(1, 33)]:
                f.seek(off)
                h.update(f.read(1 << 20 if off in (0, size - (1 << 20)) else 1 << 16))
    return {"size": size, kind: h.hexdigest()}
