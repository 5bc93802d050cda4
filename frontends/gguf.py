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

from .arch import ARCHITECTURES, ModelConfig, ModelError, WeightInfo, check_weights

#: GGUF architectures we read -> (our family row, RoPE layout in the file)
FAMILIES: dict[str, str] = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "gemma3": "gemma3"}


@dataclass
class GGUFModel:
    path: str
    config: ModelConfig
    weights: dict[str, WeightInfo]
    reader: Any
    metadata: dict[str, Any]


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        v = f.contents()
    except Exception:  # a malformed field: treat as absent, the caller checks
        return default
    return v


def open_reader(path: str):
    """GGUFReader, with its failures turned into one-line ModelErrors."""
    from gguf import GGUFReader

    try:
        return GGUFReader(path, "r")
    except Exception as e:  # the reader raises ValueError, struct errors, IndexError ...
        size = os.path.getsize(path)
        raise ModelError(f"{path}: not a readable GGUF file ({type(e).__name__}: {str(e).splitlines()[0][:120]}; "
                         f"{size} bytes)") from None


def load_gguf(path: str | os.PathLike) -> GGUFModel:
    path = os.fspath(path)
    reader = open_reader(path)
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
    for t in reader.tensors:
        name = t.name[:-7] if t.name.endswith(".weight") else t.name
        qtype = t.tensor_type.name
        try:
            layout = get_layout(qtype)
        except KeyError:
            raise ModelError(f"{path}: tensor {t.name} has quant type {qtype}, which lmc does not support") from None
        shape = tuple(int(d) for d in reversed([int(x) for x in t.shape]))
        start = int(t.data_offset)
        nbytes = int(t.n_bytes)
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
    meta_all = {k: _field(reader, k) for k in reader.fields if not k.startswith("tokenizer.ggml.")}
    return GGUFModel(path, cfg, weights, reader, meta_all)
