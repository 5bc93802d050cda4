"""The weight image of a model with compressed layers (QSF).

Compiled code addresses every weight as one base pointer plus a constant
offset. A compressed layer has no place in the file where its plain bytes
lie, so the image is the file mapped read-only, followed (past the file's
last page) by anonymous memory holding the decompressed layers
(``ir.graph.PackedRegion`` says where each one goes). One address range:
the file part is the same page-cache mapping a plain model gets, and only
the decompressed layers cost private memory. Layers that stream are left
out; the stream reader decompresses them into its buffers instead.

Decompression reads straight from the file mapping into place through the
codecs' C entry points (``frontends.qsf_codecs.native_decompressor``): no
intermediate copy of a layer is made.
"""
from __future__ import annotations

import ctypes
import mmap
import os
from dataclasses import dataclass

import numpy as np

from frontends.qsf_codecs import CodecError, decompress, native_decompressor

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = 0x10

_LZ4 = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int)
_ZSTD = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t)


@dataclass(frozen=True)
class Region:
    """A packed region as the manifest records it (``ir.graph.PackedRegion``)."""

    codec: str
    file_offset: int
    stored: int
    image_offset: int
    size: int


class WeightImage:
    """The file, then its decompressed regions, at one address."""

    def __init__(self, path: str, regions: list[Region], image_size: int, skip: frozenset[int] = frozenset()) -> None:
        self.path = path
        with open(path, "rb") as f:
            fsize = os.fstat(f.fileno()).st_size
            self.size = max(image_size, fsize, 1)
            base = _libc.mmap(None, self.size, mmap.PROT_READ | mmap.PROT_WRITE,
                              mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
            if base in (None, _MAP_FAILED):
                raise OSError(ctypes.get_errno(), f"cannot reserve {self.size} bytes for the weight image")
            self.address = base
            if fsize:
                got = _libc.mmap(base, fsize, mmap.PROT_READ, mmap.MAP_PRIVATE | _MAP_FIXED, f.fileno(), 0)
                if got != base:
                    self.close()
                    raise OSError(ctypes.get_errno(), f"{path}: cannot map the file into the weight image")
        self.array = np.ctypeslib.as_array((ctypes.c_uint8 * self.size).from_address(base))
        try:
            for r in regions:
                if r.image_offset in skip:
                    continue
                if r.file_offset + r.stored > fsize or r.image_offset < fsize or r.image_offset + r.size > self.size:
                    raise CodecError(f"region {r.file_offset}+{r.stored} -> {r.image_offset}+{r.size} does not fit")
                self._unpack(r)
        except CodecError as e:
            self.close()
            raise OSError(f"{path}: a compressed layer at byte {r.file_offset}: {e}") from None

    def _unpack(self, r: Region) -> None:
        src, dst = self.address + r.file_offset, self.address + r.image_offset
        try:
            fn = native_decompressor(r.codec)
        except CodecError:   # no C entry point (zstd without the system library): through Python
            data = decompress(r.codec, bytes(self.array[r.file_offset: r.file_offset + r.stored]), r.size)
            ctypes.memmove(dst, data, r.size)
            return
        if r.codec == "lz4":
            got = _LZ4(fn)(src, dst, r.stored, r.size)
        else:
            got = _ZSTD(fn)(dst, r.size, src, r.stored)
        if got != r.size:
            raise CodecError(f"{r.codec} data decompresses to {got} bytes, the index says {r.size}")

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        if getattr(self, "address", 0):
            self.array = None
            _libc.munmap(self.address, self.size)
            self.address = 0


def regions_of(manifest_image: dict) -> list[Region]:
    return [Region(**r) for r in manifest_image.get("regions", [])]
