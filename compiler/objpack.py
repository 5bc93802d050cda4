"""Several object files in one blob: a plain ``ar`` archive.

An artifact's code is a glue object (the step functions) plus one object
per kernel, each kernel compiled once and shared through the kernel cache;
the artifact keeps them together as one blob. ``ar`` is the standard
container for that (``ar t``/``ar x`` list and extract it); members are
named ``0.o``, ``1.o`` … in link order. A blob that is a single object (an
artifact from before kernels were compiled apart) unpacks to itself.
"""
from __future__ import annotations

AR_MAGIC = b"!<arch>\n"
_HEADER = 60


class PackError(ValueError):
    """A blob whose archive structure does not hold together."""


def pack(objects: list[bytes]) -> bytes:
    """One blob of ``objects``, in order."""
    out = [AR_MAGIC]
    for i, obj in enumerate(objects):
        name = f"{i}.o/".encode()
        if len(name) > 16:
            raise PackError(f"too many objects ({len(objects)})")
        out.append(name.ljust(16) + b"0".ljust(12) + b"0".ljust(6) + b"0".ljust(6) + b"644".ljust(8)
                   + str(len(obj)).encode().ljust(10) + b"`\n")
        out.append(obj)
        if len(obj) % 2:
            out.append(b"\n")
    return b"".join(out)


def is_pack(blob: bytes) -> bool:
    return blob[: len(AR_MAGIC)] == AR_MAGIC


def unpack(blob: bytes) -> list[bytes]:
    """The objects of ``blob`` in order (``[blob]`` if it is not a pack).
    PackError if a member's header or size does not fit the blob."""
    if not is_pack(blob):
        return [blob]
    objs, p = [], len(AR_MAGIC)
    while p < len(blob):
        head = blob[p: p + _HEADER]
        if len(head) < _HEADER or head[58:60] != b"`\n":
            raise PackError(f"bad archive member header at byte {p}")
        try:
            size = int(head[48:58].decode("ascii").strip())
        except ValueError:
            raise PackError(f"bad archive member size at byte {p}") from None
        p += _HEADER
        if size < 0 or p + size > len(blob):
            raise PackError(f"archive member at byte {p} runs past the end ({size} bytes)")
        objs.append(blob[p: p + size])
        p += size + (size % 2)
    return objs
