"""The weight image of a model with compressed layers (QSF) or repacked
weights (``passes/repack``).

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

import numpy as np

from frontends.qsf_codecs import CodecError, decompress, native_decompressor
from ir.graph import PackedRegion
from ir.quant.repack import split_repacked

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = 0x10
_MADV_DONTNEED = 4
_MADV_HUGEPAGE = 14
_HUGE = 2 << 20
_PAGE = mmap.PAGESIZE

_LZ4 = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int)
_ZSTD = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t)


#: a packed region as the manifest records it
Region = PackedRegion


class WeightImage:
    """The file, then its decompressed regions, at one address."""

    def __init__(self, path: str, regions: list[Region], image_size: int, skip: frozenset[int] = frozenset(),
                 repack_key: str | None = None, streamed_repacked: bool = False, settle_later: bool = False) -> None:
        """``repack_key``: names the repacked regions' bytes in the cache
        (``compiler.repack_cache``): mapped from there when present, else
        built and stored there for the next load. ``streamed_repacked``:
        some repacked weights stream (a memory budget), so their bytes must
        be in a file (``repacked_fd``), never built in this process's memory.
        ``settle_later``: map the cached repacked bytes as their page cache
        holds them now, leaving ``settle`` to put them on 2 MiB pages
        (``runtime.weight_map``): a cold start maps an entry its compile
        wrote a moment ago, whose reading again would delay the first token."""
        self.path = path
        self._settle_later = settle_later
        self._unsettled: tuple[str, int, int] | None = None
        #: how the repacked weights got here: "mapped" (the cache), "built" (repacked now), None (none)
        self.repacked: str | None = None
        #: an open descriptor of the file of the repacked weights (streamed ones are read from it), or -1
        self.repacked_fd = -1
        self._streamed_repacked = streamed_repacked
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
        past = -(-fsize // _HUGE) * _HUGE
        if self.size > past:   # what every step reads: on 2 MiB pages where the kernel allows
            _libc.madvise(ctypes.c_void_p(base + past), ctypes.c_size_t(self.size - past), _MADV_HUGEPAGE)
        todo = [r for r in regions if r.image_offset not in skip]
        r = None
        try:
            for r in todo:
                if r.file_offset + r.stored > fsize or r.image_offset < fsize or r.image_offset + r.size > self.size:
                    raise CodecError(f"region {r.file_offset}+{r.stored} -> {r.image_offset}+{r.size} does not fit")
            for r in todo:
                if r.codec != "repack":
                    self._unpack(r)
            r = None
            repack = [r for r in todo if r.codec == "repack"]
            if repack:
                self._repacked(repack, repack_key)
        except (CodecError, ValueError, OSError) as e:
            self.close()
            where = f"a {r.codec} region at byte {r.file_offset}" if r is not None else "its repacked weights"
            raise OSError(f"{path}: {where}: {e}") from None

    def _repacked(self, regions: list[Region], key: str | None) -> None:
        """The repacked weights: the compiler's cached bytes mapped over
        their span of the image (``compiler.repack_cache``), or repacked
        here, the file pages they were read from handed back (they stay in
        the page cache, out of this process's resident set), and cached."""
        from compiler import repack_cache

        lo, hi = repack_cache.span(regions)
        if self._streamed_repacked:
            self._file_backed(regions, key, lo, hi)
            return
        if key is not None and self._map_cached(repack_cache.lookup(key, hi - lo), lo, hi - lo):
            self.repacked = "mapped"
            return
        self.repacked = "built"
        repack_cache.repack_into(self.array, self.array[lo:hi], regions, lo)
        for r in regions:
            a = -(-r.file_offset // _PAGE) * _PAGE
            b = (r.file_offset + r.stored) // _PAGE * _PAGE
            if b > a:
                _libc.madvise(ctypes.c_void_p(self.address + a), ctypes.c_size_t(b - a), _MADV_DONTNEED)
        if key is not None:
            repack_cache.store(key, self.array[lo:hi])

    def _file_backed(self, regions: list[Region], key: str | None, lo: int, hi: int) -> None:
        """Streamed repacked weights: their file (the cache's entry, written
        now if it is missing; a temporary file when the cache is off) is
        mapped over the span and kept open for the stream reader."""
        import tempfile

        from compiler import repack_cache

        path = repack_cache.lookup(key, hi - lo) if key is not None else None
        if path is None and key is not None:
            repack_cache.prepare(self.path, key, regions)
            path = repack_cache.lookup(key, hi - lo)
        if path is not None:
            self.repacked_fd = os.open(path, os.O_RDONLY)
        else:   # no cache: a file of our own, gone when it is closed
            with tempfile.TemporaryFile(prefix="lmc-repacked-") as f:
                repack_cache.write_file(self.path, f.fileno(), regions)
                self.repacked_fd = os.dup(f.fileno())
        got = _libc.mmap(self.address + lo, hi - lo, mmap.PROT_READ, mmap.MAP_PRIVATE | _MAP_FIXED,
                         self.repacked_fd, 0)
        if got != self.address + lo:
            raise OSError(ctypes.get_errno(), "cannot map the repacked weights")
        self.repacked = "mapped" if path is not None else "file"

    def _map_cached(self, path: str | None, lo: int, size: int) -> bool:
        """Map the cache entry at ``path`` read-only over image bytes [lo, lo + size)."""
        if path is None:
            return False
        from .weight_map import map_weights

        try:
            if self._settle_later:
                self._unsettled = (path, lo, size)
            else:
                map_weights(path).close()      # its page cache on large folios, if it can be
            with open(path, "rb") as f:
                got = _libc.mmap(self.address + lo, size, mmap.PROT_READ, mmap.MAP_PRIVATE | _MAP_FIXED,
                                 f.fileno(), 0)
            return got == self.address + lo
        except OSError:
            return False

    def settle(self) -> None:
        """Put the cached repacked bytes mapped with ``settle_later`` on 2 MiB
        pages where the kernel can (``weight_map.map_weights`` reads the
        file again if it must), so the next load finds them there. Their
        span reads as zeros meanwhile: only while no step runs."""
        if self._unsettled is None:
            return
        from .weight_map import map_weights

        path, lo, size = self._unsettled
        self._unsettled = None
        at = self.address + lo
        # the file's pages must not be mapped while they are dropped and read again
        if _libc.mmap(at, size, mmap.PROT_READ, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED, -1, 0) != at:
            raise OSError(ctypes.get_errno(), "cannot unmap the repacked weights")
        try:
            map_weights(path).close()
        finally:
            with open(path, "rb") as f:
                got = _libc.mmap(at, size, mmap.PROT_READ, mmap.MAP_PRIVATE | _MAP_FIXED, f.fileno(), 0)
            if got != at:
                raise OSError(ctypes.get_errno(), f"{path}: cannot map the repacked weights again")

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
        if getattr(self, "repacked_fd", -1) >= 0:
            os.close(self.repacked_fd)
            self.repacked_fd = -1
        if getattr(self, "address", 0):
            self.array = None
            _libc.munmap(self.address, self.size)
            self.address = 0


def regions_of(manifest_image: dict) -> list[Region]:
    """The manifest's regions; an artifact of format 1 or 2 named a repacked
    region's layout and width together ("Q5_0x16")."""
    out = []
    for r in manifest_image.get("regions", []):
        if r.get("codec") == "repack" and "repack" not in r:
            base, width = split_repacked(r["layout"])
            r = {**r, "layout": base, "repack": width}
        out.append(Region(**r))
    return out
