"""Write a QSF file: header, layer index, embedding, layers, final section, tokenizer.

Layers are written as they come (a converter quantizes one layer at a time,
so a large model never sits in memory whole); the header and the index are
filled in at the end. Everything goes to ``OUTPUT.part`` and is renamed into
place only when complete, so a failed conversion leaves nothing half-written.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
import numpy as np

from . import qsf_codecs
from .output_file import atomic_output
from .qsf_format import (HEADER_SIZE, SECTION_HEAD, Header, LayerEntry, TensorEntry, align_up, crc32,
                         group_header_size, index_size, pack_group_header, pack_index, pack_section_head,
                         pack_tokenizer)


@dataclass
class QSFTensor:
    """One tensor to write: its name inside its section, quant type, shape
    (outermost first) and stored bytes."""

    name: str
    qtype: str
    shape: tuple[int, ...]
    data: np.ndarray | bytes


@dataclass
class QSFLayer:
    tensors: list[QSFTensor]
    qtype: str              # the layer's main type, for the index
    importance: float = 0.0


def pack_group(tensors: list[QSFTensor]) -> tuple[bytes, bytes]:
    """(table, data) of a tensor group: the table with every data offset
    counted from the table's start, the data 64-aligned per tensor."""
    head = group_header_size(len(tensors))
    entries, chunks, top = [], [], head
    for t in tensors:
        raw = t.data.tobytes() if isinstance(t.data, np.ndarray) else bytes(t.data)
        entries.append(TensorEntry(t.name, t.qtype, tuple(int(d) for d in t.shape), top, len(raw)))
        pad = align_up(len(raw)) - len(raw)
        chunks += [raw, bytes(pad)]
        top += len(raw) + pad
    return pack_group_header(entries), b"".join(chunks)


class QSFWriter:
    """``with QSFWriter(path, header, n_layers, compression) as w:`` then
    ``w.embedding(...)``, ``w.layer(...)`` per layer in order, ``w.final(...)``,
    ``w.tokenizer(...)``. The header's offsets and sizes are filled in here."""

    def __init__(self, path: str, header: Header, compression: str = "none", level: int | None = None,
                 always_compress: bool = False) -> None:
        if compression not in qsf_codecs.CODECS:
            raise qsf_codecs.CodecError(f"unknown compression {compression!r}")
        self.path = path
        self.header = replace(header)
        self.compression, self.level = compression, level
        self.always_compress = always_compress   # keep compressed layers even when larger (tests, benchmarks)
        self.entries: list[LayerEntry] = []
        self._f = None

    def __enter__(self) -> "QSFWriter":
        self._out = atomic_output(self.path)   # a temporary file beside the target, renamed once complete
        self._f = self._out.__enter__()
        n = self.header.n_layers
        self.header.index_offset = HEADER_SIZE
        self._f.write(bytes(align_up(HEADER_SIZE + index_size(n))))   # filled in by _finish()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        """The index and header written, then the file renamed into place; on an
        error (the block's, or a check of ``_finish``) the temporary file goes."""
        if exc_type is None:
            try:
                self._finish()
            except BaseException as e:
                if not self._out.__exit__(type(e), e, e.__traceback__):
                    raise
                return False
        return bool(self._out.__exit__(exc_type, exc, tb))

    # --- sections -----------------------------------------------------------------------
    def _pad(self) -> int:
        pos = self._f.tell()
        self._f.write(bytes(align_up(pos) - pos))
        return align_up(pos)

    def _section(self, name: str, payload: bytes) -> int:
        """A section header and its payload, padded so the payload (and so
        each tensor in a group) starts 64-aligned; returns the header's offset."""
        pos = self._f.tell()
        start = align_up(pos + SECTION_HEAD) - SECTION_HEAD
        self._f.write(bytes(start - pos))
        self._f.write(pack_section_head(name, payload))
        self._f.write(payload)
        return start

    def _group(self, name: str, tensors: list[QSFTensor]) -> int:
        table, data = pack_group(tensors)
        return self._section(name, table + data)

    def embedding(self, tensors: list[QSFTensor]) -> None:
        self.header.embedding_offset = self._group("embedding", tensors)

    def layer(self, layer: QSFLayer) -> LayerEntry:
        """Write one layer; returns its index entry (compression kept only
        where it makes the layer smaller)."""
        table, data = pack_group(layer.tensors)
        codec = self.compression
        if codec != "none":
            packed = qsf_codecs.compress(codec, data, self.level)
            if len(packed) < len(data) or self.always_compress:
                data_stored = packed
            else:
                codec, data_stored = "none", data
        else:
            data_stored = data
        stored = table + data_stored
        at = self._pad()
        self._f.write(stored)
        e = LayerEntry(at, len(stored), len(table) + len(data), layer.qtype, codec, len(layer.tensors),
                       crc32(stored), float(layer.importance))
        self.entries.append(e)
        return e

    def final(self, tensors: list[QSFTensor]) -> None:
        self.header.final_offset = self._group("final", tensors)

    def tokenizer(self, kind: str, blob: bytes) -> None:
        self.header.tokenizer_offset = self._section("tokenizer", pack_tokenizer(kind, blob))

    def _finish(self) -> None:
        f = self._f
        h = self.header
        if len(self.entries) != h.n_layers:
            raise ValueError(f"{self.path}: {len(self.entries)} layers written, the header says {h.n_layers}")
        for what in ("embedding_offset", "final_offset", "tokenizer_offset"):
            if not getattr(h, what):
                raise ValueError(f"{self.path}: no {what.split('_')[0]} section was written")
        h.file_size = f.tell()
        f.seek(h.index_offset)
        f.write(pack_index(self.entries))
        f.seek(0)
        f.write(h.pack())
        f.flush()
        os.fsync(f.fileno())


