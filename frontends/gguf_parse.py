"""A direct GGUF header parser: metadata and tensor infos in one pass, and
the header's byte layout.

``gguf.GGUFReader`` builds a numpy view per array element, ~9 s for a
262144-token vocabulary; reading the header with ``struct`` and numpy takes
a fraction of a second. ``parse_gguf`` gives exactly what
``gguf.metadata_from_reader`` makes of the reader's fields (strings as bytes,
string arrays as ``StringArray``, numeric arrays as native-order numpy,
scalars as Python values, plus the reader's ``GGUF.version``/
``tensor_count``/``kv_count``), for little- and big-endian files. Every
length and count is checked against the file before it is used; what this
parser does not handle (arrays of arrays) raises ``Unsupported`` so the
caller can fall back to the package's reader.

``gguf_layout`` walks the same header without decoding values, for where
things are (``lmc inspect``'s sections): the end of the metadata, of the
tensor infos, the start of the data, and for a file cut short, where it
ends.
"""
from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from .arch import ModelError
from .string_table import StringArray

#: GGUF value types -> (struct format, numpy dtype), without the byte order, for the fixed-size ones
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("B", "u1"), 1: ("b", "i1"), 2: ("H", "u2"), 3: ("h", "i2"), 4: ("I", "u4"),
    5: ("i", "i4"), 6: ("f", "f4"), 7: ("?", "?"), 10: ("Q", "u8"), 11: ("q", "i8"),
    12: ("d", "f8"),
}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32


class Unsupported(ValueError):
    """A valid GGUF feature this parser leaves to ``gguf.GGUFReader``."""


class Truncated(ValueError):
    """The file ends before what its header describes."""


class _Cursor:
    """Reads a GGUF header in the file's byte order (``<`` or ``>``)."""

    def __init__(self, buf: Any, order: str = "<") -> None:
        self.buf = buf
        self.size = len(buf)
        self.p = 0
        self.order = order
        self._u32 = struct.Struct(order + "I")
        self._u64 = struct.Struct(order + "Q")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.p + n > self.size:
            raise Truncated(f"{what} at byte {self.p} runs past the end of the file")

    def u32(self) -> int:
        self.need(4, "a 32-bit value")
        (v,) = self._u32.unpack_from(self.buf, self.p)
        self.p += 4
        return v

    def u64(self) -> int:
        self.need(8, "a 64-bit value")
        (v,) = self._u64.unpack_from(self.buf, self.p)
        self.p += 8
        return v

    def skip(self, n: int, what: str) -> None:
        self.need(n, what)
        self.p += n

    def string(self) -> bytes:
        n = self.u64()
        self.need(n, f"a string of {n} bytes")
        s = bytes(self.buf[self.p: self.p + n])
        self.p += n
        return s

    def scalar(self, t: int) -> Any:
        fmt = self.order + _SCALARS[t][0]
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
        dt = np.dtype(self.order + _SCALARS[et][1])
        self.need(n * dt.itemsize, f"an array of {n} values")
        if n == 0:
            return np.zeros(0)
        arr = np.frombuffer(self.buf, dt, n, self.p)
        self.p += n * dt.itemsize
        return arr.astype(dt.newbyteorder("="), copy=True)

    def strings(self, n: int) -> StringArray:
        """``n`` length-prefixed strings as one blob (no object per string)."""
        self.need(n * 8, f"an array of {n} strings")
        buf, p, size, unpack = self.buf, self.p, self.size, self._u64.unpack_from
        view = memoryview(buf)
        lens = np.empty(n, np.int64)
        blob = bytearray()
        try:
            for i in range(n):
                if p + 8 > size:
                    raise Truncated(f"string {i} of {n} at byte {p} runs past the end of the file")
                (k,) = unpack(buf, p)
                p += 8
                if k > size - p:
                    raise Truncated(f"string {i} of {n} at byte {p} ({k} bytes) runs past the end of the file")
                lens[i] = k
                blob += view[p: p + k]
                p += k
        finally:
            view.release()
        self.p = p
        return StringArray.from_lengths(blob, lens)

    def skip_value(self, t: int) -> bool:
        """Step over a value without decoding it; False for a type GGUF does not have."""
        if t in _SCALARS:
            self.skip(struct.calcsize(_SCALARS[t][0]), "a value")
        elif t == _STRING:
            self.skip(self.u64(), "a string")
        elif t == _ARRAY:
            et, n = self.u32(), self.u64()
            if et in _SCALARS:
                self.skip(n * struct.calcsize(_SCALARS[et][0]), f"an array of {n} values")
            else:
                for _ in range(n):
                    if not self.skip_value(et):
                        return False
        else:
            return False
        return True

    def tensor_info(self) -> tuple[str, int, tuple[int, ...], int]:
        """(name, its type's number, dims as stored, offset in the data);
        past 8 dimensions (name, -1, (their count,), -1), the rest unread."""
        name = self.string().decode("utf-8", "replace")
        nd = self.u32()
        if nd > 8:
            return name, -1, (nd,), -1
        self.need(8 * nd, f"tensor {name}'s {nd} dimensions")
        dims = tuple(int(d) for d in np.frombuffer(self.buf, self.order + "u8", nd, self.p)) if nd else ()
        self.p += 8 * nd
        return name, self.u32(), dims, self.u64()


def _open(path: str):
    with open(path, "rb") as f:
        try:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:   # an empty file
            raise Truncated("the file is empty") from None


def _close(mm) -> None:
    try:
        mm.close()
    except BufferError:   # a view still held by an exception's frames: closed when collected
        pass


def _byte_order(version: int) -> tuple[str, int]:
    """The file's byte order and version, from the version as read little-endian."""
    if version and version & 0xFFFF == 0:   # a big-endian file
        return ">", struct.unpack(">I", struct.pack("<I", version))[0]
    return "<", version


def parse_gguf(path: str) -> tuple[dict[str, Any], list[tuple[str, str, tuple[int, ...], int, int]]]:
    """Metadata and tensor infos (name, quant type name, dims as stored,
    absolute data offset, bytes) of the GGUF file at ``path``. ValueError
    (with where) for a malformed file; ``Unsupported`` for the rare valid
    file this parser does not read."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    mm = _open(path)
    try:
        c = _Cursor(mm)
        c.need(4, "the magic")
        if mm[:4] != b"GGUF":
            raise ValueError("GGUF magic invalid")
        c.p = 4
        order, version = _byte_order(c.u32())
        c = _Cursor(mm, order)
        c.p = 8
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
            dims = tuple(int(d) for d in np.frombuffer(mm, order + "u8", nd, c.p)) if nd else ()
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
        _close(mm)


@dataclass
class GGUFLayout:
    """Where a GGUF header's parts are, as stored (``gguf_layout``)."""

    magic: bytes
    version: int
    n_tensors: int
    n_kv: int
    alignment: int
    #: end of the header and metadata; end of the tensor infos; start of the (aligned) tensor data
    kv_end: int
    infos_end: int
    data_start: int
    #: (name, type number, dims as stored, offset from data_start) of each tensor
    infos: list[tuple[str, int, tuple[int, ...], int]]

    def truncation(self, path: str, size: int) -> str | None:
        """Which tensor a file of ``size`` bytes stops short of, if any."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        for name, qt, dims, off in self.infos:
            try:
                block, nb = GGML_QUANT_SIZES[GGMLQuantizationType(qt)]
            except (ValueError, KeyError):
                continue
            end = self.data_start + off + math.prod(dims) // block * nb
            if end > size:
                return f"{path}: truncated: tensor {name} needs bytes up to {end}, the file has {size}"
        return None


def gguf_layout(path: str) -> GGUFLayout:
    """The byte layout of a GGUF header, values stepped over, not decoded
    (``parse_gguf`` gives them); a clear ModelError for a file cut short
    (where the gguf package's reader fails obscurely), a value type GGUF
    does not have, or a tensor of more than 8 dimensions."""
    try:
        mm = _open(path)
    except Truncated:
        raise ModelError(f"{path}: truncated: the file (0 bytes) ends inside the GGUF header") from None
    where = "header"
    try:
        c = _Cursor(mm)
        c.need(8, "the magic and version")
        magic = bytes(mm[:4])
        c.p = 4
        order, version = _byte_order(c.u32())
        c = _Cursor(mm, order)
        c.p = 8
        n_tensors, n_kv = c.u64(), c.u64()
        where = "metadata"
        alignment = DEFAULT_ALIGNMENT
        for _ in range(n_kv):
            key = c.string()
            vt = c.u32()
            if key == b"general.alignment" and vt == _UINT32:
                alignment = c.u32()
            elif not c.skip_value(vt):
                raise ModelError(f"{path}: metadata value type {vt} is not a GGUF type")
        kv_end = c.p
        where = "tensor infos"
        infos = []
        for _ in range(n_tensors):
            name, qt, dims, off = c.tensor_info()
            if qt < 0:
                raise ModelError(f"{path}: tensor {name} has {dims[0]} dimensions")
            infos.append((name, qt, dims, off))
    except Truncated:
        raise ModelError(f"{path}: truncated: the file ({c.size} bytes) ends inside the GGUF {where}") from None
    finally:
        _close(mm)
    data_start = -(-c.p // alignment) * alignment if alignment > 0 else c.p
    return GGUFLayout(magic, version, n_tensors, n_kv, alignment, kv_end, c.p, data_start, infos)
