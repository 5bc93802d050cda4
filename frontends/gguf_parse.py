"""A direct GGUF header parser: metadata and tensor infos in one pass.

``gguf.GGUFReader`` builds a numpy view per array element, ~9 s for a
262144-token vocabulary; reading the header with ``struct`` and numpy takes
a fraction of a second. It gives exactly what ``gguf._metadata_from_reader``
made of the reader's fields (strings as bytes, string arrays as
``StringArray``, numeric arrays as native-order numpy, scalars as Python
values, plus the reader's ``GGUF.version``/``tensor_count``/``kv_count``).
Every length and count is checked against the file before it is used; what
this parser does not handle (big-endian files, arrays of arrays) raises
``Unsupported`` so the caller can fall back to the package's reader.
"""
from __future__ import annotations

import mmap
import struct
from typing import Any

import numpy as np

from .string_table import StringArray

#: GGUF value types -> (struct format, numpy dtype) for the fixed-size ones
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"), 4: ("<I", "<u4"),
    5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "?"), 10: ("<Q", "<u8"), 11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}
_STRING, _ARRAY = 8, 9
_VERSIONS = (2, 3)
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
DEFAULT_ALIGNMENT = 32


class Unsupported(ValueError):
    """A valid GGUF feature this parser leaves to ``gguf.GGUFReader``."""


class _Cursor:
    def __init__(self, buf: Any) -> None:
        self.buf = buf
        self.size = len(buf)
        self.p = 0

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.p + n > self.size:
            raise ValueError(f"{what} at byte {self.p} runs past the end of the file")

    def u32(self) -> int:
        self.need(4, "a 32-bit value")
        (v,) = _U32.unpack_from(self.buf, self.p)
        self.p += 4
        return v

    def u64(self) -> int:
        self.need(8, "a 64-bit value")
        (v,) = _U64.unpack_from(self.buf, self.p)
        self.p += 8
        return v

    def string(self) -> bytes:
        n = self.u64()
        self.need(n, f"a string of {n} bytes")
        s = bytes(self.buf[self.p: self.p + n])
        self.p += n
        return s

    def scalar(self, t: int) -> Any:
        fmt, _ = _SCALARS[t]
        size = struct.calcsize(fmt)
        self.need(size, "a value")
        (v,) = struct.unpack_from(fmt, self.buf, self.p)
        self.p += size
        return v

    def value(self, t: int) -> Any:
        if t in _SCALARS:
            return self.scalar(t)
        if t == _STRING:
            return self.string()
        if t == _ARRAY:
            return self.array()
        raise ValueError(f"unknown metadata value type {t} at byte {self.p - 4}")

    def array(self) -> Any:
        et = self.u32()
        n = self.u64()
        if et == _STRING:
            return self.strings(n)
        if et == _ARRAY:
            raise Unsupported("an array of arrays")
        if et not in _SCALARS:
            raise ValueError(f"unknown array element type {et} at byte {self.p - 12}")
        dt = np.dtype(_SCALARS[et][1])
        self.need(n * dt.itemsize, f"an array of {n} values")
        if n == 0:
            return np.zeros(0)
        arr = np.frombuffer(self.buf, dt, n, self.p)
        self.p += n * dt.itemsize
        return arr.astype(dt.newbyteorder("="), copy=True)

    def strings(self, n: int) -> StringArray:
        """``n`` length-prefixed strings as one blob (no object per string)."""
        self.need(n * 8, f"an array of {n} strings")
        buf, p, size, unpack = self.buf, self.p, self.size, _U64.unpack_from
        view = memoryview(buf)
        lens = np.empty(n, np.int64)
        blob = bytearray()
        try:
            for i in range(n):
                if p + 8 > size:
                    raise ValueError(f"string {i} of {n} at byte {p} runs past the end of the file")
                (k,) = unpack(buf, p)
                p += 8
                if k > size - p:
                    raise ValueError(f"string {i} of {n} at byte {p} ({k} bytes) runs past the end of the file")
                lens[i] = k
                blob += view[p: p + k]
                p += k
        finally:
            view.release()
        self.p = p
        return StringArray.from_lengths(blob, lens)


def parse_gguf(path: str) -> tuple[dict[str, Any], list[tuple[str, str, tuple[int, ...], int, int]]]:
    """Metadata and tensor infos (name, quant type name, dims as stored,
    absolute data offset, bytes) of the GGUF file at ``path``. ValueError
    (with where) for a malformed file; ``Unsupported`` for the rare valid
    file this parser does not read."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f:
        try:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:   # an empty file
            raise ValueError("the file is empty") from None
    try:
        c = _Cursor(mm)
        c.need(4, "the magic")
        if mm[:4] != b"GGUF":
            raise ValueError("GGUF magic invalid")
        c.p = 4
        version = c.u32()
        if version & 0xFFFF == 0:
            raise Unsupported("a big-endian file")
        if version not in _VERSIONS:
            raise ValueError(f"file appears to be version {version}, which cannot be read")
        n_tensors, n_kv = c.u64(), c.u64()
        meta: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv}
        for _ in range(n_kv):
            key = c.string().decode("utf-8")
            if key in meta:
                raise ValueError(f"duplicate metadata key {key}")
            meta[key] = c.value(c.u32())
        infos = []
        for _ in range(n_tensors):
            name = c.string().decode("utf-8")
            nd = c.u32()
            c.need(8 * nd, f"tensor {name}'s {nd} dimensions")
            dims = tuple(int(d) for d in np.frombuffer(mm, "<u8", nd, c.p)) if nd else ()
            c.p += 8 * nd
            raw, off = c.u32(), c.u64()
            try:
                qt = GGMLQuantizationType(raw)
            except ValueError:
                raise ValueError(f"tensor {name} has an unknown type {raw}") from None
            infos.append((name, qt, dims, off))
        align = meta.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or isinstance(align, bool) or align <= 0 or align & (align - 1):
            raise ValueError(f"invalid alignment {align!r}: must be a non-zero power of two")
        start = c.p + (-c.p) % align
        tensors, names = [], set()
        for name, qt, dims, off in infos:
            if name in names:
                raise ValueError(f"duplicated tensor {name}")
            names.add(name)
            block, tsize = GGML_QUANT_SIZES[qt]
            n = 1
            for d in dims:
                n *= d
            nbytes = n * tsize // block
            if start + off + nbytes > c.size:
                raise ValueError(f"tensor {name}'s data ({nbytes} bytes at {start + off}) lies outside the file")
            tensors.append((name, qt.name, dims, start + off, nbytes))
        return meta, tensors
    finally:
        try:
            mm.close()
        except BufferError:   # a view still held by an exception's frames: closed when collected
            pass
