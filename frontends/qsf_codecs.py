"""Per-layer compression of QSF files: LZ4 (block format) and zstandard.

Both come from their packages on the index (``lz4``, ``zstandard``). LZ4
blocks carry no size of their own: the layer index records it, and the
decompressed length must equal it exactly. The native stream reader calls
the same libraries' C entry points (``native_decompressor``), so a layer
streamed from disk is decompressed on the I/O thread without Python.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools

CODECS = ("none", "lz4", "zstd")


class CodecError(ValueError):
    pass


def compress(codec: str, data: bytes, level: int | None = None) -> bytes:
    if codec == "lz4":
        import lz4.block

        mode = "high_compression" if (level or 0) > 0 else "default"
        return lz4.block.compress(data, mode=mode, compression=level or 0, store_size=False)
    if codec == "zstd":
        import zstandard

        return zstandard.ZstdCompressor(level=level or 9, write_content_size=True).compress(data)
    raise CodecError(f"unknown compression {codec!r} (one of {', '.join(CODECS)})")


def decompress(codec: str, data: bytes, size: int) -> bytes:
    """Exactly ``size`` bytes, or CodecError (corrupt or mismatched input)."""
    try:
        if codec == "lz4":
            import lz4.block

            out = lz4.block.decompress(data, uncompressed_size=size)
        elif codec == "zstd":
            import zstandard

            out = zstandard.ZstdDecompressor().decompress(data, max_output_size=size)
        else:
            raise CodecError(f"unknown compression {codec!r}")
    except CodecError:
        raise
    except Exception as e:  # lz4.block.LZ4BlockError, zstandard.ZstdError ...
        raise CodecError(f"{codec} data does not decompress ({e})") from None
    if len(out) != size:
        raise CodecError(f"{codec} data decompresses to {len(out)} bytes, the index says {size}")
    return out


def read_region(path: str, region):
    """A compressed region's plain bytes (``ir.graph.PackedRegion``), read
    from ``path`` and decompressed: the interpreter's ``WeightStore.unpack``."""
    import numpy as np

    with open(path, "rb") as f:
        f.seek(region.file_offset)
        data = f.read(region.stored)
    if len(data) != region.stored:
        raise CodecError(f"{path}: short read of a compressed layer at byte {region.file_offset}")
    return np.frombuffer(decompress(region.codec, data, region.size), np.uint8)


@functools.cache
def native_decompressor(codec: str) -> int:
    """Address of a C decompression function for the native I/O thread:
    lz4 -> ``int LZ4_decompress_safe(src, dst, srcSize, dstCapacity)`` (from
    the lz4 package's extension, which exports it), zstd -> ``size_t
    ZSTD_decompress(dst, dstCapacity, src, srcSize)`` (the system libzstd;
    the zstandard package does not export it). CodecError when missing."""
    if codec == "lz4":
        import lz4.block._block as mod

        lib = ctypes.CDLL(mod.__file__)
        name = "LZ4_decompress_safe"
    elif codec == "zstd":
        path = ctypes.util.find_library("zstd")
        if path is None:
            raise CodecError("streaming zstd layers needs the system's libzstd (not found); "
                             "use --compress lz4, or run without streaming")
        lib = ctypes.CDLL(path)
        name = "ZSTD_decompress"
    else:
        raise CodecError(f"no native decompressor for {codec!r}")
    try:
        return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0
    except AttributeError:
        raise CodecError(f"{name} is not exported by {lib._name}") from None
