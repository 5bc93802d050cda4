"""QSF ("Quantized Streaming Format") version 1: the byte layout, nothing else.

Pure packing and unpacking of the fixed structures (``docs/qsf.md`` is the
specification; this module is its executable form). Reading a file, checking
checksums and building a model live in ``frontends/qsf.py``; writing in
``frontends/qsf_writer.py``. Every unpack validates what it can see on its
own and raises ``QSFError`` naming the structure, so a reader never trusts a
number it has not checked.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, fields

MAGIC = b"QSF1"
VERSION = 1
HEADER_SIZE = 128
ALIGN = 64          # every section and every tensor's data starts on a multiple of this
NAME_BYTES = 24     # tensor names (relative to their section: "attn_q", "ffn_down" ...)


class QSFError(ValueError):
    """A QSF structure that does not hold together; the caller adds the file name."""


# --- enumerations (codes stored in the file) ----------------------------------------------
ARCHS = {0: "llama", 1: "mistral", 2: "qwen2", 3: "gemma3", 4: "qwen3", 5: "phi3", 6: "gpt2", 7: "starcoder2",
         8: "phi2", 9: "gemma2"}
QTYPES = {0: "F32", 1: "F16", 2: "QSF_Q8", 3: "QSF_Q4", 4: "QSF_Q2", 5: "QSF_Q2S", 6: "QSF_TERNARY"}
#: the header's default quant type may also say "mixed" (per-tensor types vary)
MIXED = 255
ACTIVATIONS = {0: "silu", 1: "gelu_tanh"}
NORMS = {0: "rmsnorm", 1: "layernorm"}
POSITIONS = {0: "rope_interleaved", 1: "rope_neox", 2: "learned"}
#: the architecture table's norm and position names -> the header's
QSF_NORMS = {"rms": "rmsnorm", "layer": "layernorm"}
QSF_POSITIONS = {"interleaved": "rope_interleaved", "neox": "rope_neox", "learned": "learned"}
COMPRESSIONS = {0: "none", 1: "lz4", 2: "zstd"}

#: header flag bits
FLAG_TIED = 1 << 0          # the output head is the token embedding (no "output" tensor)
FLAG_QKV_BIAS = 1 << 1
FLAG_QK_NORM = 1 << 2
FLAG_POST_NORMS = 1 << 3
FLAG_EMBED_SCALE = 1 << 4
KNOWN_FLAGS = FLAG_TIED | FLAG_QKV_BIAS | FLAG_QK_NORM | FLAG_POST_NORMS | FLAG_EMBED_SCALE


def code_of(table: dict[int, str], name: str, what: str) -> int:
    for k, v in table.items():
        if v == name:
            return k
    raise QSFError(f"{what} {name!r} has no QSF code (known: {', '.join(table.values())})")


def name_of(table: dict[int, str], code: int, what: str) -> str:
    if code not in table:
        raise QSFError(f"unknown {what} code {code}")
    return table[code]


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def crc32(data) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


# --- the header (128 bytes) -----------------------------------------------------------------
# magic, version, header_size, arch, default qtype, activation, norm, position, flags, rope_dims,
# n_layers, dim, n_heads, n_kv_heads, vocab, context, ffn, head_dim, rope_theta, norm_eps,
# rope_local_theta, sliding_window, swa_every, bos, eos, pad,
# index_offset, embedding_offset, final_offset, tokenizer_offset, file_size, attn_softcap, final_softcap, crc
# (rope_dims and the soft-caps were reserved zero bytes in the first files: zero means none)
_HEADER = struct.Struct("<4sHHBBBBBBH" "8I" "fff" "II" "iii" "5Q" "ee" "I")
assert _HEADER.size == HEADER_SIZE, _HEADER.size


@dataclass
class Header:
    version: int
    arch: str
    qtype: str                 # a QTYPES name or "mixed"
    activation: str
    norm: str
    position: str
    flags: int
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    context: int
    ffn_dim: int
    head_dim: int
    rope_theta: float
    norm_eps: float
    rope_local_theta: float    # 0: every layer uses rope_theta
    sliding_window: int        # 0: no sliding-window layers
    swa_every: int             # with a window: every n-th layer is global
    bos_id: int
    eos_id: int
    pad_id: int                # -1: none
    index_offset: int
    embedding_offset: int
    final_offset: int
    tokenizer_offset: int
    file_size: int
    crc: int = 0
    rope_dims: int = 0         # dims of a head RoPE rotates; 0: all (less: partial rotary, Phi-2)
    attn_softcap: float = 0.0  # attention-logit soft-cap (Gemma 2); 0: none; stored as f16
    final_softcap: float = 0.0  # final-logit soft-cap; 0: none; stored as f16

    def __post_init__(self) -> None:
        # the file stores these as f32: hold exactly what will be read back
        for k in ("rope_theta", "norm_eps", "rope_local_theta"):
            setattr(self, k, struct.unpack("<f", struct.pack("<f", getattr(self, k)))[0])
        for k in ("attn_softcap", "final_softcap"):
            v = float(getattr(self, k))
            if struct.unpack("<e", struct.pack("<e", v))[0] != v:
                raise QSFError(f"header: {k} {v} is not exact in float16 (QSF stores it so)")

    def pack(self) -> bytes:
        """The 128 bytes, with the CRC32 of the first 124 filled in."""
        qt = MIXED if self.qtype == "mixed" else code_of(QTYPES, self.qtype, "quant type")
        vals = (MAGIC, self.version, HEADER_SIZE, code_of(ARCHS, self.arch, "architecture"), qt,
                code_of(ACTIVATIONS, self.activation, "activation"), code_of(NORMS, self.norm, "norm"),
                code_of(POSITIONS, self.position, "position encoding"), self.flags, self.rope_dims,
                self.n_layers, self.dim, self.n_heads, self.n_kv_heads, self.vocab_size, self.context,
                self.ffn_dim, self.head_dim, self.rope_theta, self.norm_eps, self.rope_local_theta,
                self.sliding_window, self.swa_every, self.bos_id, self.eos_id, self.pad_id,
                self.index_offset, self.embedding_offset, self.final_offset, self.tokenizer_offset,
                self.file_size, self.attn_softcap, self.final_softcap, 0)
        body = _HEADER.pack(*vals)[:-4]
        self.crc = crc32(body)
        return body + struct.pack("<I", self.crc)

    @classmethod
    def unpack(cls, data: bytes) -> "Header":
        if len(data) < HEADER_SIZE:
            raise QSFError(f"header: {len(data)} bytes, a QSF header has {HEADER_SIZE}")
        v = _HEADER.unpack_from(data)
        if v[0] != MAGIC:
            raise QSFError(f"header: magic {v[0]!r} is not {MAGIC!r}")
        if v[1] != VERSION:
            raise QSFError(f"header: version {v[1]} (this lmc reads QSF version {VERSION})")
        if v[2] != HEADER_SIZE:
            raise QSFError(f"header: header size {v[2]}, version {VERSION} has {HEADER_SIZE}")
        crc = crc32(data[:HEADER_SIZE - 4])
        if crc != v[-1]:
            raise QSFError(f"header: CRC32 mismatch (stored {v[-1]:08x}, computed {crc:08x})")
        flags = v[8]
        if flags & ~KNOWN_FLAGS:
            raise QSFError(f"header: unknown flag bits {flags & ~KNOWN_FLAGS:#x}")
        h = cls(v[1], name_of(ARCHS, v[3], "architecture"),
                "mixed" if v[4] == MIXED else name_of(QTYPES, v[4], "quant type"),
                name_of(ACTIVATIONS, v[5], "activation"), name_of(NORMS, v[6], "norm"),
                name_of(POSITIONS, v[7], "position encoding"), flags, *v[10:31], crc=v[-1], rope_dims=v[9],
                attn_softcap=v[31], final_softcap=v[32])
        return h

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


# --- the layer index ----------------------------------------------------------------------
# [u32 count][u32 entry size] count x entry, then a u32 CRC32 of everything before it.
_INDEX_HEAD = struct.Struct("<II")
# offset, stored size, decompressed size, qtype, compression, tensor count, crc32, importance, reserved
_ENTRY = struct.Struct("<QQQBBHIf4x")
assert _ENTRY.size == 40


@dataclass
class LayerEntry:
    offset: int          # absolute file offset of the layer's stored bytes (64-aligned)
    stored: int          # bytes in the file (compressed size if compressed)
    size: int            # bytes once decompressed (== stored when not compressed)
    qtype: str           # the layer's main quant type (a QTYPES name, or "mixed")
    compression: str     # COMPRESSIONS name
    tensors: int
    crc: int             # CRC32 of the stored bytes
    importance: float    # calibration sensitivity; 0 = not measured


def index_size(n_layers: int) -> int:
    return _INDEX_HEAD.size + n_layers * _ENTRY.size + 4


def pack_index(entries: list[LayerEntry]) -> bytes:
    out = bytearray(_INDEX_HEAD.pack(len(entries), _ENTRY.size))
    for e in entries:
        qt = MIXED if e.qtype == "mixed" else code_of(QTYPES, e.qtype, "quant type")
        out += _ENTRY.pack(e.offset, e.stored, e.size, qt, code_of(COMPRESSIONS, e.compression, "compression"),
                           e.tensors, e.crc, e.importance)
    out += struct.pack("<I", crc32(out))
    return bytes(out)


def unpack_index(data: bytes, n_layers: int) -> list[LayerEntry]:
    need = index_size(n_layers)
    if len(data) < need:
        raise QSFError(f"index: {len(data)} bytes, {n_layers} layers need {need}")
    count, esize = _INDEX_HEAD.unpack_from(data)
    if count != n_layers or esize != _ENTRY.size:
        raise QSFError(f"index: {count} entries of {esize} bytes, the header says {n_layers} of {_ENTRY.size}")
    stored_crc = struct.unpack_from("<I", data, need - 4)[0]
    crc = crc32(data[:need - 4])
    if crc != stored_crc:
        raise QSFError(f"index: CRC32 mismatch (stored {stored_crc:08x}, computed {crc:08x})")
    out = []
    for i in range(count):
        off, stored, size, qt, comp, nt, c, imp = _ENTRY.unpack_from(data, _INDEX_HEAD.size + i * _ENTRY.size)
        out.append(LayerEntry(off, stored, size, "mixed" if qt == MIXED else name_of(QTYPES, qt, "quant type"),
                              name_of(COMPRESSIONS, comp, "compression"), nt, c, imp))
    return out


# --- sections -----------------------------------------------------------------------------
# Embedding, final and tokenizer sections start with [tag 4s][u32 crc32 of payload][u64 payload size].
_SECTION = struct.Struct("<4sIQ")
SECTION_HEAD = _SECTION.size
TAGS = {"embedding": b"EMBD", "final": b"FINL", "tokenizer": b"TOKN"}


def pack_section_head(name: str, payload: bytes) -> bytes:
    return _SECTION.pack(TAGS[name], crc32(payload), len(payload))


def unpack_section_head(name: str, data: bytes) -> tuple[int, int]:
    """(payload crc32, payload size) of section ``name``."""
    if len(data) < SECTION_HEAD:
        raise QSFError(f"{name} section: truncated header")
    tag, crc, size = _SECTION.unpack_from(data)
    if tag != TAGS[name]:
        raise QSFError(f"{name} section: tag {tag!r}, expected {TAGS[name]!r}")
    return crc, size


# --- tensor groups (a layer's section, and the embedding and final sections' payloads) -------
# [u32 tensor count][u32 reserved] count x tensor header, zero padding to 64 (the "table"),
# then the tensor data. In a compressed layer only the data is compressed: the table stays
# plain, so opening a file reads every tensor's place without decompressing anything.
_GROUP_HEAD = struct.Struct("<I4x")
# name (NUL-padded), qtype, ndim, 2 reserved, 4 x u32 dims (outermost first), data offset
# relative to the group's start, data size, 4 reserved
_TENSOR = struct.Struct(f"<{NAME_BYTES}sBB2x4IQQ4x")
assert _TENSOR.size == 64


@dataclass
class TensorEntry:
    name: str
    qtype: str
    shape: tuple[int, ...]     # outermost first: [rows, cols] for matrices
    offset: int                # from the start of the group (64-aligned)
    nbytes: int


def group_header_size(n: int) -> int:
    return align_up(_GROUP_HEAD.size + n * _TENSOR.size)


def pack_group_header(tensors: list[TensorEntry]) -> bytes:
    out = bytearray(_GROUP_HEAD.pack(len(tensors)))
    for t in tensors:
        name = t.name.encode()
        if len(name) > NAME_BYTES:
            raise QSFError(f"tensor name {t.name!r} is longer than {NAME_BYTES} bytes")
        if not 1 <= len(t.shape) <= 4:
            raise QSFError(f"tensor {t.name}: rank {len(t.shape)} (QSF stores 1 to 4 dims)")
        dims = list(t.shape) + [0] * (4 - len(t.shape))
        out += _TENSOR.pack(name, code_of(QTYPES, t.qtype, "quant type"), len(t.shape), *dims, t.offset, t.nbytes)
    out += bytes(group_header_size(len(tensors)) - len(out))
    return bytes(out)


def unpack_group(data: bytes, size: int, what: str) -> list[TensorEntry]:
    """Tensor entries of a group of ``size`` bytes whose first bytes are ``data``;
    every tensor's data must lie inside the group, after the headers."""
    if size < _GROUP_HEAD.size or len(data) < _GROUP_HEAD.size:
        raise QSFError(f"{what}: truncated tensor table")
    (n,) = _GROUP_HEAD.unpack_from(data)
    head = group_header_size(n)
    if n > 4096 or head > size or len(data) < _GROUP_HEAD.size + n * _TENSOR.size:
        raise QSFError(f"{what}: {n} tensors do not fit in {size} bytes")
    out = []
    for i in range(n):
        raw, qt, ndim, *rest = _TENSOR.unpack_from(data, _GROUP_HEAD.size + i * _TENSOR.size)
        dims, off, nbytes = rest[:4], rest[4], rest[5]
        try:
            name = raw.rstrip(b"\0").decode()
        except UnicodeDecodeError:
            raise QSFError(f"{what}: tensor {i} has a name that is not UTF-8") from None
        if not 1 <= ndim <= 4 or any(d <= 0 for d in dims[:ndim]):
            raise QSFError(f"{what}: tensor {name!r} has shape {dims[:ndim]} (rank {ndim})")
        if off % ALIGN or off < head or off + nbytes > size:
            raise QSFError(f"{what}: tensor {name!r} data {off}..{off + nbytes} lies outside its section "
                           f"({head}..{size})")
        out.append(TensorEntry(name, name_of(QTYPES, qt, "quant type"), tuple(dims[:ndim]), off, nbytes))
    return out


# --- the tokenizer section's payload --------------------------------------------------------
# [u32 kind][u32 reserved] then the kind's bytes
TOKENIZER_KINDS = {1: "llama2c", 2: "gguf-metadata"}
_TOK_HEAD = struct.Struct("<I4x")


def pack_tokenizer(kind: str, blob: bytes) -> bytes:
    return _TOK_HEAD.pack(code_of(TOKENIZER_KINDS, kind, "tokenizer kind")) + blob


def unpack_tokenizer(payload: bytes) -> tuple[str, bytes]:
    if len(payload) < _TOK_HEAD.size:
        raise QSFError("tokenizer section: truncated")
    (kind,) = _TOK_HEAD.unpack_from(payload)
    return name_of(TOKENIZER_KINDS, kind, "tokenizer kind"), payload[_TOK_HEAD.size:]
