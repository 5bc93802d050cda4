"""QSF models: open, check, and map out every tensor (``docs/qsf.md``).

Opening reads the 128-byte header (its CRC32 checked, the file size it
records compared with the real one, so a truncated file is refused at
once), the layer index (its own CRC32), the embedding and final sections'
tensor tables and every layer's table; nothing else. Every offset and size
is checked against the file and the config before anything reads weights.

Data checksums (each layer's stored bytes, the embedding and final
payloads) are verified when the data is first read for a run
(``verify``): the runtime asks for it before native code sees the weights.
A file that passed is remembered by path, size, modification time and
header CRC, so the full read happens once per file, not once per run.

Compressed layers (LZ4 or zstandard, per layer) keep their tensor table
plain; only their data is compressed. Their tensors are addressed in the
model's weight image, the file followed by the decompressed layers
(``ir.graph.PackedRegion``), which the runtime builds on load or the stream
reader fills layer by layer.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from ir.digest import sha256
from ir.graph import PackedRegion, WeightRef
from ir.quant import get_layout
from ir.types import TensorType

from .arch import ARCHITECTURES, ModelConfig, ModelError, WeightInfo, check_weights
from .cache_dir import cache_root
from .qsf_format import (ALIGN, FLAG_EMBED_SCALE, FLAG_POST_NORMS, FLAG_QK_NORM, FLAG_QKV_BIAS, FLAG_TIED,
                         QSF_NORMS, QSF_POSITIONS,
                         HEADER_SIZE, SECTION_HEAD, Header, LayerEntry, QSFError, TensorEntry,
                         group_header_size, index_size, unpack_group, unpack_index, unpack_section_head,
                         unpack_tokenizer)

PAGE = 4096
_READ_CHUNK = 8 << 20


@dataclass
class Section:
    """A byte range of the file with a checksum: a tensor-group section's
    payload, the tokenizer's, or a layer's stored bytes."""

    name: str
    offset: int           # of the payload (or the layer's stored bytes)
    stored: int
    crc: int
    size: int = 0          # decompressed (layers); == stored otherwise
    compression: str = "none"
    tensors: list[TensorEntry] = field(default_factory=list)
    image_offset: int = -1     # compressed layers: where the decompressed layer sits in the image


@dataclass
class QSFFile:
    path: str
    file_size: int
    header: Header
    layers: list[LayerEntry]
    sections: list[Section]          # embedding, layer 0..L-1, final, tokenizer (file order)
    image_size: int                  # the file plus its decompressed layers

    def section(self, name: str) -> Section:
        return next(s for s in self.sections if s.name == name)


def _read(f, offset: int, n: int, what: str, size: int) -> bytes:
    if offset < 0 or n < 0 or offset + n > size:
        raise QSFError(f"{what}: bytes {offset}..{offset + n} lie outside the file ({size} bytes)")
    f.seek(offset)
    data = f.read(n)
    if len(data) != n:
        raise QSFError(f"{what}: short read")
    return data


def open_qsf(path: str | os.PathLike) -> QSFFile:
    """Header, index and tensor tables of a QSF file; ModelError names the
    file and the section at fault."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            return _open(f, path, os.fstat(f.fileno()).st_size)
    except QSFError as e:
        raise ModelError(f"{path}: {e}") from None
    except OSError as e:
        raise ModelError(f"{path}: cannot read: {e.strerror}") from None


def _open(f, path: str, size: int) -> QSFFile:
    if size < HEADER_SIZE:
        raise QSFError(f"truncated: {size} bytes, shorter than the {HEADER_SIZE}-byte header")
    h = Header.unpack(_read(f, 0, HEADER_SIZE, "header", size))
    if h.file_size != size:
        raise QSFError(f"the header records {h.file_size} bytes, the file has {size} "
                       f"({'truncated' if size < h.file_size else 'trailing bytes'})")
    if not 0 < h.n_layers <= 4096:
        raise QSFError(f"header: {h.n_layers} layers is out of range")
    if h.index_offset != HEADER_SIZE:
        raise QSFError(f"header: index offset {h.index_offset}, version 1 puts it at {HEADER_SIZE}")
    order = [("index", h.index_offset), ("embedding", h.embedding_offset), ("final", h.final_offset),
             ("tokenizer", h.tokenizer_offset)]
    for (a, x), (b, y) in zip(order, order[1:]):
        if not x < y < size:
            raise QSFError(f"header: section offsets out of order or outside the file ({a} at {x}, {b} at {y})")
    layers = unpack_index(_read(f, h.index_offset, index_size(h.n_layers), "index", size), h.n_layers)

    sections: list[Section] = []

    def group_section(name: str, at: int, end: int) -> Section:
        crc, n = unpack_section_head(name, _read(f, at, SECTION_HEAD, f"{name} section", size))
        start = at + SECTION_HEAD
        if start % ALIGN or start + n > end:
            raise QSFError(f"{name} section: payload {start}..{start + n} does not fit before {end}")
        head = _read(f, start, min(n, 8), f"{name} section", size)
        count = int.from_bytes(head[:4], "little") if len(head) >= 4 else 0
        table = _read(f, start, min(n, group_header_size(min(count, 4096))), f"{name} section", size)
        return Section(name, start, n, crc, n, tensors=unpack_group(table, n, f"{name} section"))

    first_layer = layers[0].offset if layers else h.final_offset
    sections.append(group_section("embedding", h.embedding_offset, first_layer))
    image = (size + PAGE - 1) // PAGE * PAGE
    prev_end = sections[0].offset + sections[0].stored
    for i, e in enumerate(layers):
        what = f"layer {i}"
        if e.offset % ALIGN or e.offset < prev_end or e.offset + e.stored > h.final_offset:
            raise QSFError(f"index: {what} at {e.offset}..{e.offset + e.stored} overlaps another section")
        table = _read(f, e.offset, min(e.stored, group_header_size(min(e.tensors, 4096))), what, size)
        tensors = unpack_group(table, e.size, what)
        if len(tensors) != e.tensors:
            raise QSFError(f"{what}: {len(tensors)} tensors, the index says {e.tensors}")
        head = group_header_size(len(tensors))
        if e.compression == "none" and e.stored != e.size:
            raise QSFError(f"index: {what} is not compressed but stores {e.stored} of {e.size} bytes")
        if e.size > 1 << 40 or (e.compression != "none" and e.size > 1024 * e.stored):
            raise QSFError(f"index: {what} claims {e.size} bytes decompressed from {e.stored}")
        if e.compression != "none" and not head < e.stored:
            raise QSFError(f"index: {what} stores {e.stored} bytes, less than its table")
        sec = Section(what, e.offset, e.stored, e.crc, e.size, e.compression, tensors)
        if e.compression != "none":
            sec.image_offset = image
            image = (image + e.size + PAGE - 1) // PAGE * PAGE
        sections.append(sec)
        prev_end = e.offset + e.stored
    fin = group_section("final", h.final_offset, h.tokenizer_offset)
    if fin.offset < prev_end:
        raise QSFError("final section overlaps the last layer")
    sections.append(fin)
    crc, n = unpack_section_head("tokenizer", _read(f, h.tokenizer_offset, SECTION_HEAD, "tokenizer section", size))
    if h.tokenizer_offset + SECTION_HEAD + n != size:
        raise QSFError(f"tokenizer section: {n} bytes do not end at the end of the file")
    sections.append(Section("tokenizer", h.tokenizer_offset + SECTION_HEAD, n, crc, n))
    return QSFFile(path, size, h, layers, sections, image)


# --- checksums --------------------------------------------------------------------------
def _stamp_path(qf: QSFFile) -> str:
    st = os.stat(qf.path)
    key = json.dumps([os.path.abspath(qf.path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino,
                      qf.header.crc])
    return os.path.join(cache_root(), "qsf-verified", sha256(key.encode()).hexdigest()[:32])


def check_section(f, sec: Section) -> int:
    """CRC32 of a section's stored bytes, read in chunks (a streamed model's
    layers never become resident for this)."""
    crc, left, at = 0, sec.stored, sec.offset
    import zlib

    while left:
        chunk = os.pread(f.fileno(), min(left, _READ_CHUNK), at)
        if not chunk:
            raise QSFError(f"{sec.name}: short read")
        crc = zlib.crc32(chunk, crc)
        at += len(chunk)
        left -= len(chunk)
    return crc & 0xFFFFFFFF


def verify(qf: QSFFile, force: bool = False) -> list[tuple[str, bool]]:
    """Check every section's CRC32; ModelError naming the first bad one.
    Skipped when this exact file was verified before (unless ``force``)."""
    stamp = _stamp_path(qf)
    if not force and os.path.exists(stamp):
        return [(s.name, True) for s in qf.sections]
    results = check_all(qf)
    bad = [name for name, ok in results if not ok]
    if bad:
        sec = qf.section(bad[0])
        raise ModelError(f"{qf.path}: {sec.name}: CRC32 mismatch (the stored bytes at {sec.offset}..."
                         f"{sec.offset + sec.stored} are corrupt)")
    try:
        os.makedirs(os.path.dirname(stamp), exist_ok=True)
        with open(stamp, "w") as f:
            f.write("ok\n")
    except OSError:
        pass
    return results


def check_all(qf: QSFFile) -> list[tuple[str, bool]]:
    """(section, CRC ok) for every section, reading the whole file once."""
    with open(qf.path, "rb") as f:
        return [(sec.name, check_section(f, sec) == sec.crc) for sec in qf.sections]


# --- the model ------------------------------------------------------------------------------
@dataclass
class QSFModel:
    file: QSFFile
    config: ModelConfig
    weights: dict[str, WeightInfo]
    tokenizer: Any


def _config(h: Header, path: str) -> ModelConfig:
    if h.arch not in ARCHITECTURES:
        raise ModelError(f"{path}: unsupported architecture {h.arch!r}")
    spec = ARCHITECTURES[h.arch]
    want = {FLAG_QKV_BIAS: spec.qkv_bias, FLAG_QK_NORM: spec.qk_norm, FLAG_POST_NORMS: spec.post_norms,
            FLAG_EMBED_SCALE: spec.embed_scale}
    for bit, on in want.items():
        if bool(h.flags & bit) != on:
            raise ModelError(f"{path}: header flags {h.flags:#x} disagree with the {h.arch} architecture")
    pos, norm = QSF_POSITIONS[spec.rope_style], QSF_NORMS[spec.norm]
    if (h.activation, h.position, h.norm, h.swa_every) != (spec.ffn_act, pos, norm, spec.swa_every):
        raise ModelError(f"{path}: header says {h.activation}/{h.position}/{h.norm}/swa every {h.swa_every}, "
                         f"the {h.arch} architecture computes {spec.ffn_act}/{pos}/{norm}/{spec.swa_every}")
    if h.rope_dims and not (spec.partial_rotary and h.rope_dims <= h.head_dim and h.rope_dims % 2 == 0):
        raise ModelError(f"{path}: header rotary dims {h.rope_dims} do not fit the {h.arch} architecture "
                         f"(head dim {h.head_dim})")
    if bool(h.attn_softcap or h.final_softcap) and not spec.softcap:
        raise ModelError(f"{path}: header sets logit soft-capping, which the {h.arch} architecture does not have")
    for k in ("dim", "n_heads", "n_kv_heads", "vocab_size", "context", "ffn_dim", "head_dim"):
        v = getattr(h, k)
        if not 0 < v <= 1 << 24:
            raise ModelError(f"{path}: header field {k} = {v} is out of range")
    if h.n_heads % h.n_kv_heads:
        raise ModelError(f"{path}: {h.n_heads} heads is not a multiple of {h.n_kv_heads} KV heads")
    extra: dict[str, Any] = {}
    if h.sliding_window:
        extra["sliding_window"] = int(h.sliding_window)
    if h.rope_local_theta:
        extra["rope_local_theta"] = float(h.rope_local_theta)
    if spec.softcap:
        extra.update(attn_softcap=float(h.attn_softcap), final_softcap=float(h.final_softcap))
    return ModelConfig(arch=h.arch, dim=h.dim, hidden_dim=h.ffn_dim, n_layers=h.n_layers, n_heads=h.n_heads,
                       n_kv_heads=h.n_kv_heads, vocab_size=h.vocab_size, seq_len=h.context, head_dim=h.head_dim,
                       rope_dims=h.rope_dims,
                       norm_eps=float(h.norm_eps), rope_theta=float(h.rope_theta),
                       tied_output=bool(h.flags & FLAG_TIED), bos_id=h.bos_id, eos_id=h.eos_id,
                       stop_ids=(h.eos_id,), extra=extra)


def _weights(qf: QSFFile) -> dict[str, WeightInfo]:
    out: dict[str, WeightInfo] = {}
    for sec in qf.sections:
        if sec.name == "tokenizer":
            continue
        prefix = f"blk.{sec.name.split()[1]}." if sec.name.startswith("layer ") else ""
        if sec.compression == "none":
            base, packed = sec.offset, None
        else:
            head = group_header_size(len(sec.tensors))
            base = sec.image_offset
            packed = PackedRegion(sec.compression, sec.offset + head, sec.stored - head, base + head, sec.size - head)
        for t in sec.tensors:
            name = prefix + t.name
            try:
                need = get_layout(t.qtype).nbytes(t.shape)
            except (KeyError, ValueError) as e:
                raise ModelError(f"{qf.path}: {sec.name}: tensor {t.name}: {e}") from None
            if need != t.nbytes:
                raise ModelError(f"{qf.path}: {sec.name}: tensor {t.name} has {t.nbytes} bytes, "
                                 f"{t.qtype} {t.shape} needs {need}")
            if name in out:
                raise ModelError(f"{qf.path}: tensor {name} appears twice")
            out[name] = WeightInfo(TensorType(t.shape, "f32", t.qtype), WeightRef(qf.path, base + t.offset, t.nbytes,
                                                                                  packed))
    return out


def read_tokenizer(qf: QSFFile, vocab_size: int):
    """The tokenizer the file carries (its CRC checked first: it is read whole).
    A GGUF-style vocabulary is read member by member from the file, so a
    262144-token vocabulary never sits in memory twice."""
    from .gguf_cache import meta_from_file
    from .gguf_tokenizer import GGUFTokenizer
    from .llama2c_tokenizer import Llama2cTokenizer

    sec = qf.section("tokenizer")
    with open(qf.path, "rb") as f:
        if check_section(f, sec) != sec.crc:
            raise ModelError(f"{qf.path}: tokenizer section: CRC32 mismatch (the stored bytes are corrupt)")
        head = _read(f, sec.offset, min(sec.stored, 8), "tokenizer section", qf.file_size)
        try:
            kind, _ = unpack_tokenizer(head)
            f.seek(sec.offset + 8)
            if kind == "llama2c":
                tok = Llama2cTokenizer.from_bytes(f.read(sec.stored - 8), os.path.basename(qf.path), vocab_size)
            else:
                tok = GGUFTokenizer.from_metadata(meta_from_file(f), qf.path)
        except (QSFError, ValueError) as e:
            raise ModelError(f"{qf.path}: tokenizer section: {e}") from None
    tok.path = os.path.abspath(qf.path)
    if tok.vocab_size != vocab_size:
        raise ModelError(f"{qf.path}: the tokenizer has {tok.vocab_size} tokens, the header says {vocab_size}")
    return tok


def load_qsf(path: str | os.PathLike) -> QSFModel:
    """Open a QSF model: config, weight references and tokenizer."""
    from .llama2c_tokenizer import Llama2cTokenizer

    qf = open_qsf(path)
    verify(qf)   # before anything reads a tensor table's claims or a weight
    cfg = _config(qf.header, qf.path)
    weights = _weights(qf)
    check_weights(cfg, weights, qf.path)
    tok = read_tokenizer(qf, cfg.vocab_size)
    stops = set(cfg.stop_ids) | set(getattr(tok, "stop_ids", ()))
    if isinstance(tok, Llama2cTokenizer):   # run.c stops when it samples BOS, and goes on past EOS
        stops = {cfg.bos_id}
    cfg.stop_ids = tuple(sorted(stops))
    return QSFModel(qf, cfg, weights, tok)


def inspect_qsf(path: str, verify: bool = False) -> dict:
    """``lmc inspect``'s report (the schema of ``runtime/cli/inspect.py``,
    which adds the per-type summary): header fields, sections, per-layer
    sizes, types, compression and, with ``verify``, every section's checksum."""
    import dataclasses

    qf = open_qsf(path)
    h = qf.header
    crcs = dict(check_all(qf)) if verify else {}
    sections = [{"name": "header", "offset": 0, "size": HEADER_SIZE},
                {"name": "index", "offset": h.index_offset, "size": index_size(h.n_layers)}]
    for sec in qf.sections:
        head = 0 if sec.name.startswith("layer ") else SECTION_HEAD
        sections.append({"name": sec.name, "offset": sec.offset - head, "size": sec.stored + head})
    layers, tensors = [], []
    for i, (e, sec) in enumerate(zip(qf.layers, qf.sections[1:-2])):
        layers.append({"index": i, "offset": e.offset, "stored": e.stored, "decompressed": e.size, "qtype": e.qtype,
                       "compression": e.compression, "tensors": e.tensors, "crc": f"{e.crc:08x}",
                       "crc_ok": crcs.get(sec.name), "importance": round(e.importance, 4)})
    for sec in qf.sections:
        prefix = f"blk.{sec.name.split()[1]}." if sec.name.startswith("layer ") else ""
        for t in sec.tensors:
            tensors.append({"name": prefix + t.name, "type": t.qtype, "shape": list(t.shape),
                            "offset": (sec.offset if sec.compression == "none" else sec.image_offset) + t.offset,
                            "nbytes": t.nbytes, "layer": int(sec.name.split()[1]) if prefix else None,
                            "section": sec.name})
    checks = [{"what": "header CRC32 and file size", "ok": True, "detail": f"{h.crc:08x}, {qf.file_size} bytes"},
              {"what": "index CRC32", "ok": True, "detail": f"{len(qf.layers)} layers"}]
    if verify:
        for name, ok in crcs.items():
            checks.append({"what": f"{name} CRC32", "ok": ok, "detail": "" if ok else "mismatch: corrupt bytes"})
    try:
        cfg = dataclasses.asdict(_config(h, path))
    except ModelError as e:
        cfg = {}
        checks.append({"what": "config", "ok": False, "detail": str(e)})
    header = h.as_dict()
    header["crc"] = f"{h.crc:08x}"
    header["image_size"] = qf.image_size
    return {"format": "qsf", "path": path, "size": qf.file_size, "header": header, "config": cfg,
            "sections": sections, "layers": layers, "tensors": tensors, "checks": checks}
