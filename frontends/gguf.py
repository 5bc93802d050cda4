"""GGUF models, read with the ``gguf`` package's reader.

Metadata becomes a ``ModelConfig``; tensors become weight references into the
file (offset, stored size, quant layout), nothing is copied. Every tensor's
bytes are checked to lie inside the file, and every shape against the
config, before anything reads them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from ir.graph import WeightRef
from ir.layouts import get_layout
from ir.types import TensorType

from .arch import ModelConfig, ModelError, WeightInfo, check_weights
from .string_table import StringArray

#: GGUF architectures we read -> (our family row, RoPE layout in the file)
FAMILIES: dict[str, str] = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "gemma3": "gemma3"}


@dataclass
class GGUFModel:
    path: str
    config: ModelConfig
    weights: dict[str, WeightInfo]
    metadata: dict[str, Any]


@dataclass(frozen=True)
class TensorRecord:
    name: str
    qtype: str
    shape: tuple[int, ...]   # GGUF order: ne[0] (columns) first
    offset: int              # absolute byte offset in the file
    nbytes: int


@dataclass
class GGUFContents:
    """What the gguf package's reader found: metadata (strings as bytes,
    string arrays as ``StringArray``, numeric arrays as numpy) and tensor infos."""

    meta: dict[str, Any]
    tensors: list[TensorRecord]


def _metadata_from_reader(reader: Any) -> dict[str, Any]:
    from gguf import GGUFValueType

    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        types = list(field.types)
        if not types:
            continue
        if types[0] == GGUFValueType.STRING:
            meta[key] = bytes(field.parts[field.data[0]])
        elif types[0] == GGUFValueType.ARRAY:
            etype = types[1] if len(types) > 1 else None
            parts = field.parts
            if etype == GGUFValueType.STRING:
                meta[key] = StringArray.from_list(bytes(parts[i]) for i in field.data)
            elif not field.data:
                meta[key] = np.zeros(0)
            else:
                arr = np.concatenate([np.asarray(parts[i]).reshape(-1) for i in field.data])
                meta[key] = arr.astype(arr.dtype.newbyteorder("="), copy=True)
        else:
            v = field.parts[field.data[0]][0]
            meta[key] = v.item() if hasattr(v, "item") else v
    return meta


def read_gguf(path: str | os.PathLike) -> GGUFContents:
    """Metadata and tensor infos of a GGUF file, read with ``gguf.GGUFReader``.

    The reader builds one numpy view per array element, which takes ~9 s for
    a 262144-token vocabulary, so what it finds is cached on disk (keyed by
    the file's path, size and modification time) and later loads take
    milliseconds. Errors become one-line ModelErrors."""
    from . import gguf_cache

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ModelError(f"{path}: no such file")
    cached = gguf_cache.load(path)
    if cached is not None:
        return GGUFContents(cached[0], [TensorRecord(*t[:2], tuple(t[2]), *t[3:]) for t in cached[1]])
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path, "r")
        meta = _metadata_from_reader(reader)
        tensors = [TensorRecord(t.name, t.tensor_type.name, tuple(int(x) for x in t.shape), int(t.data_offset),
                                int(t.n_bytes)) for t in reader.tensors]
    except Exception as e:  # the reader raises ValueError, struct errors, IndexError ...
        size = os.path.getsize(path)
        first = (str(e).splitlines() or [""])[0][:120]
        raise ModelError(f"{path}: not a readable GGUF file ({type(e).__name__}: {first}; {size} bytes)") from None
    gguf_cache.store(path, meta, [(t.name, t.qtype, list(t.shape), t.offset, t.nbytes) for t in tensors])
    return GGUFContents(meta, tensors)


def _str(v: Any) -> Any:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else v


def load_gguf(path: str | os.PathLike) -> GGUFModel:
    path = os.fspath(path)
    contents = read_gguf(path)
    md = contents.meta

    def _field(_: Any, key: str, default: Any = None) -> Any:
        v = md.get(key, default)
        return _str(v)

    reader = None
    arch = _field(reader, "general.architecture")
    if arch not in FAMILIES:
        raise ModelError(f"{path}: unsupported architecture {arch!r} (supported: {', '.join(sorted(FAMILIES))})")
    a = arch

    def meta(key: str, default: Any = None, required: bool = False) -> Any:
        v = _field(reader, f"{a}.{key}", default)
        if required and v is None:
            raise ModelError(f"{path}: metadata {a}.{key} is missing")
        return v

    size = os.path.getsize(path)
    weights: dict[str, WeightInfo] = {}
    for t in contents.tensors:
        name = t.name[:-7] if t.name.endswith(".weight") else t.name
        qtype = t.qtype
        try:
            layout = get_layout(qtype)
        except KeyError:
            raise ModelError(f"{path}: tensor {t.name} has quant type {qtype}, which lmc does not support") from None
        shape = tuple(int(d) for d in reversed([int(x) for x in t.shape]))
        start = int(t.offset)
        nbytes = int(t.nbytes)
        if start < 0 or start + nbytes > size:
            raise ModelError(f"{path}: tensor {t.name} data {start}..{start + nbytes} lies outside the file "
                             f"({size} bytes)")
        try:
            need = layout.nbytes(shape)
        except ValueError as e:
            raise ModelError(f"{path}: tensor {t.name}: {e}") from None
        if need != nbytes:
            raise ModelError(f"{path}: tensor {t.name} has {nbytes} bytes, {qtype} {shape} needs {need}")
        weights[name] = WeightInfo(TensorType(shape, "f32", qtype), WeightRef(path, start, nbytes))

    if "token_embd" not in weights:
        raise ModelError(f"{path}: missing tensor token_embd.weight")
    dim = int(meta("embedding_length", required=True))
    n_heads = int(meta("attention.head_count", required=True))
    head_dim = int(meta("attention.key_length", dim // max(n_heads, 1)))
    vocab = int(weights["token_embd"].type.shape[0])
    extra: dict[str, Any] = {}
    if arch == "gemma3":
        extra["sliding_window"] = int(meta("attention.sliding_window", 512))
        extra["rope_local_theta"] = 10000.0
    n_kv = meta("attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):
        raise ModelError(f"{path}: per-layer KV head counts are not supported")
    cfg = ModelConfig(
        arch=FAMILIES[arch],
        dim=dim,
        hidden_dim=int(meta("feed_forward_length", required=True)),
        n_layers=int(meta("block_count", required=True)),
        n_heads=n_heads,
        n_kv_heads=int(n_kv),
        vocab_size=vocab,
        seq_len=int(meta("context_length", 2048)),
        head_dim=head_dim,
        norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        tied_output="output" not in weights,
        extra=extra,
    )
    for k, v in (("dim", cfg.dim), ("n_layers", cfg.n_layers), ("n_heads", cfg.n_heads),
                 ("n_kv_heads", cfg.n_kv_heads), ("hidden_dim", cfg.hidden_dim), ("head_dim", cfg.head_dim)):
        if not 0 < v <= 1 << 20:
            raise ModelError(f"{path}: metadata {k} = {v} is out of range")
    if cfg.n_heads % cfg.n_kv_heads:
        raise ModelError(f"{path}: head_count {cfg.n_heads} is not a multiple of head_count_kv {cfg.n_kv_heads}")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    if bos is not None:
        cfg.bos_id = int(bos)
    if eos is not None:
        cfg.eos_id = int(eos)
    cfg.stop_ids = (cfg.eos_id,)
    check_weights(cfg, weights, path)
    return GGUFModel(path, cfg, weights, md)
