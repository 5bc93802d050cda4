"""GGUF models: metadata and tensor infos from the file's header.

Metadata becomes a ``ModelConfig``; tensors become weight references into the
file (offset, stored size, quant layout), nothing is copied. Every tensor's
bytes are checked to lie inside the file, and every shape against the
config, before anything reads them.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from ir.graph import WeightRef
from ir.quant import get_layout
from ir.types import TensorType

from .arch import (ARCHITECTURES, ROPE_SCALING_TYPES, ModelConfig, ModelError, RopeScaling, WeightInfo,
                   check_weights, split_fused)
from .string_table import StringArray

#: GGUF architectures we read -> our family row (``frontends.arch.ARCHITECTURES``)
FAMILIES: dict[str, str] = {a: a for a in ("llama", "mistral", "qwen2", "qwen3", "phi2", "phi3", "gpt2",
                                             "starcoder2", "gemma2", "gemma3")}

#: ``{arch}.*`` metadata keys lmc reads, for every family; values that
#: would need what lmc lacks are refused where they are read
UNDERSTOOD_KEYS = frozenset({
    "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.key_length", "attention.value_length",
    "attention.layer_norm_rms_epsilon", "attention.sliding_window",
    "rope.freq_base", "rope.dimension_count",
    "rope.scaling.type", "rope.scaling.factor", "rope.scale_linear", "rope.scaling.original_context_length",
    "rope.scaling.attn_factor", "rope.scaling.finetuned",
    "expert_count", "expert_used_count",
})

#: keys a family reads on top of ``UNDERSTOOD_KEYS`` (what the row implements)
_LAYERNORM_KEYS = frozenset({"attention.layer_norm_epsilon"})
_SOFTCAP_KEYS = frozenset({"attn_logit_softcapping", "final_logit_softcapping"})


def family_keys(arch: str) -> frozenset[str]:
    """The ``{arch}.*`` keys lmc reads for ``arch``."""
    spec = ARCHITECTURES[FAMILIES[arch]]
    keys = UNDERSTOOD_KEYS
    if spec.norm == "layer":
        keys = keys | _LAYERNORM_KEYS
    if spec.softcap:
        keys = keys | _SOFTCAP_KEYS
    return keys


#: keys known to change the computation, with what they do (a clearer refusal)
COMPUTATION_KEYS = {
    "attn_logit_softcapping": "attention-logit soft-capping",
    "final_logit_softcapping": "final-logit soft-capping",
    "attention.scale": "a custom attention scale",
    "logit_scale": "scaled output logits",
    "embedding_scale": "scaled embeddings",
    "residual_scale": "scaled residuals",
    "attention.clamp_kqv": "clamped Q/K/V",
    "attention.max_alibi_bias": "ALiBi position biases",
    "attention.layer_norm_epsilon": "LayerNorm (lmc's families use RMSNorm)",
    "attention.causal": "non-causal attention",
    "use_parallel_residual": "parallel attention and FFN branches",
    "rope.dimension_sections": "multi-section (M-RoPE) rotary embeddings",
    "rope.freq_base_swa": "a separate RoPE base for sliding-window layers",
    "attention.sliding_window_pattern": "a custom sliding-window layer pattern",
    "rope.scaling.yarn_log_multiplier": "YaRN's log-multiplier attention factor",
    "rope.scaling.yarn_ext_factor": "a custom YaRN extrapolation mix",
    "rope.scaling.yarn_attn_factor": "a custom YaRN attention factor",
    "rope.scaling.yarn_beta_fast": "custom YaRN correction dimensions",
    "rope.scaling.yarn_beta_slow": "custom YaRN correction dimensions",
    "rope.scaling.alpha": "NTK-alpha RoPE scaling",
}


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


def metadata_from_reader(reader: Any) -> dict[str, Any]:
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
    """Metadata and tensor infos of a GGUF file.

    ``gguf_parse`` reads the header directly (a tenth of a second for a
    262144-token vocabulary); the rare file it leaves alone (arrays of
    arrays) goes through ``gguf.GGUFReader``, which builds a numpy
    view per array element. What was found is cached on disk (keyed by the
    file's path, size and modification time): later loads skip even the
    parse. Errors become one-line ModelErrors."""
    from . import gguf_cache
    from .gguf_parse import Unsupported, parse_gguf

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ModelError(f"{path}: no such file")
    cached = gguf_cache.load(path)
    if cached is not None:
        return GGUFContents(cached[0], [TensorRecord(*t[:2], tuple(t[2]), *t[3:]) for t in cached[1]])
    try:
        try:
            meta, infos = parse_gguf(path)
            tensors = [TensorRecord(*t) for t in infos]
        except Unsupported:
            meta, tensors = _read_with_package(path)
    except Exception as e:  # ValueError, UnicodeDecodeError, struct errors, the package's IndexError ...
        size = os.path.getsize(path)
        first = (str(e).splitlines() or [""])[0][:120]
        raise ModelError(f"{path}: not a readable GGUF file ({type(e).__name__}: {first}; {size} bytes)") from None
    gguf_cache.store(path, meta, [(t.name, t.qtype, list(t.shape), t.offset, t.nbytes) for t in tensors])
    return GGUFContents(meta, tensors)


def _read_with_package(path: str) -> tuple[dict[str, Any], list[TensorRecord]]:
    from gguf import GGUFReader

    reader = GGUFReader(path, "r")
    meta = metadata_from_reader(reader)
    tensors = [TensorRecord(t.name, t.tensor_type.name, tuple(int(x) for x in t.shape), int(t.data_offset),
                            int(t.n_bytes)) for t in reader.tensors]
    return meta, tensors


def _str(v: Any) -> Any:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else v


def _short(v: Any) -> str:
    text = repr(_str(v))
    return text if len(text) <= 40 else text[:37] + "..."


def check_metadata(path: str, md: dict[str, Any], arch: str) -> None:
    """Every ``{arch}.*`` key is one lmc reads: a key that changes the
    computation and that lmc does not implement fails the load, in one line,
    before anything runs (never a silently different model)."""
    a = arch + "."
    understood = family_keys(arch)
    for key, value in md.items():
        if key.startswith(a):
            sub = key[len(a):]
            if sub in understood:
                continue
            what = COMPUTATION_KEYS.get(sub)
            why = f"it sets {what}" if what else "lmc does not know this key, and it may change the computation"
            raise ModelError(f"{path}: metadata {key} = {_short(value)}: {why}; lmc's {FAMILIES[arch]} family "
                             f"does not implement it")
    if int(md.get("split.count", 1) or 1) > 1:
        raise ModelError(f"{path}: one part of a split GGUF (split.count = {md['split.count']}); merge the parts "
                         f"into one file (llama-gguf-split --merge)")
    if _str(md.get("general.type")) == "adapter":
        raise ModelError(f"{path}: a LoRA adapter (general.type = adapter), not a model")


def _rope_scaling(path: str, meta: Any, n_ctx_train: int) -> RopeScaling:
    """The RoPE scaling llama.cpp applies for these keys: a factor alone
    means linear; type ``none`` ignores the factor; YaRN's original context
    defaults to the training context."""
    kind = meta("rope.scaling.type", "linear")
    if kind not in ROPE_SCALING_TYPES:
        raise ModelError(f"{path}: rope.scaling.type {kind!r} is not implemented (lmc implements "
                         f"{', '.join(ROPE_SCALING_TYPES)})")
    factor = meta("rope.scaling.factor")
    if factor is None:
        factor = meta("rope.scale_linear", 0.0)
    factor = float(factor)
    attn = float(meta("rope.scaling.attn_factor", 1.0))
    orig = int(meta("rope.scaling.original_context_length", n_ctx_train))
    for name, v in (("rope.scaling.factor", factor), ("rope.scaling.attn_factor", attn)):
        if not (math.isfinite(v) and (v > 0 or (name == "rope.scaling.factor" and v == 0))):
            raise ModelError(f"{path}: metadata {name} = {v} is not a positive number")
    if kind == "none" or factor == 0.0:
        factor = 1.0
    if kind == "yarn" and not 0 < orig <= 1 << 24:
        raise ModelError(f"{path}: rope.scaling.original_context_length {orig} is out of range")
    if factor == 1.0:
        return RopeScaling(attn_factor=attn)
    return RopeScaling(kind=kind, factor=factor, orig_ctx=orig if kind == "yarn" else 0, attn_factor=attn)


def load_gguf(path: str | os.PathLike) -> GGUFModel:
    path = os.fspath(path)
    contents = read_gguf(path)
    md = contents.meta
    arch = _str(md.get("general.architecture"))
    if arch not in FAMILIES:
        raise ModelError(f"{path}: unsupported architecture {arch!r} (supported: {', '.join(sorted(FAMILIES))})")
    check_metadata(path, md, arch)

    def meta(key: str, default: Any = None, required: bool = False) -> Any:
        v = _str(md.get(f"{arch}.{key}", default))
        if required and v is None:
            raise ModelError(f"{path}: metadata {arch}.{key} is missing")
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
    spec = ARCHITECTURES[FAMILIES[arch]]
    dim = int(meta("embedding_length", required=True))
    n_heads = int(meta("attention.head_count", required=True))
    head_dim = int(meta("attention.key_length", dim // max(n_heads, 1)))
    vocab = int(weights["token_embd"].type.shape[0])
    n_ctx_train = int(meta("context_length", 2048))
    if not 0 < n_ctx_train <= 1 << 24:   # 0 would pass every check here and fail later, blaming -c or the prompt
        raise ModelError(f"{path}: metadata {arch}.context_length = {n_ctx_train} is out of range (1 to {1 << 24})")
    extra: dict[str, Any] = {}
    window = int(meta("attention.sliding_window", 0))
    if spec.swa_every:
        extra["sliding_window"] = window or spec.default_window
        if spec.local_rope_theta:
            extra["rope_local_theta"] = spec.local_rope_theta
    elif window and arch != "phi3":  # llama.cpp turns Phi-3's window off (its converters set it wrongly)
        # Mistral's window: every layer attends to the last `window` positions (Hugging Face's
        # MistralAttention); llama.cpp's llama architecture ignores the key (see tests/test_kv_ring.py)
        extra["sliding_window"] = window
    if spec.softcap:  # llama.cpp's defaults when a Gemma 2 file leaves them out
        extra["attn_softcap"] = float(meta("attn_logit_softcapping", 50.0))
        extra["final_softcap"] = float(meta("final_logit_softcapping", 30.0))
        for k in ("attn_softcap", "final_softcap"):
            if not (math.isfinite(extra[k]) and extra[k] >= 0):
                raise ModelError(f"{path}: a soft-capping value of {extra[k]} is not a non-negative number")
    n_kv = meta("attention.head_count_kv", n_heads)
    if isinstance(n_kv, (list, np.ndarray, StringArray)):
        raise ModelError(f"{path}: per-layer KV head counts are not supported")
    n_experts = int(meta("expert_count", 0) or 0)
    if n_experts:
        raise ModelError(f"{path}: metadata {arch}.expert_count = {n_experts}: mixture-of-experts layers are not "
                         f"implemented in lmc")
    eps_key = "attention.layer_norm_epsilon" if spec.norm == "layer" else "attention.layer_norm_rms_epsilon"
    rope_dims = int(meta("rope.dimension_count", head_dim)) if spec.rope_style != "learned" else head_dim
    cfg = ModelConfig(
        arch=FAMILIES[arch],
        dim=dim,
        hidden_dim=int(meta("feed_forward_length", required=True)),
        n_layers=int(meta("block_count", required=True)),
        n_heads=n_heads,
        n_kv_heads=int(n_kv),
        vocab_size=vocab,
        seq_len=n_ctx_train,
        head_dim=head_dim,
        rope_dims=rope_dims if spec.partial_rotary else head_dim,
        norm_eps=float(meta(eps_key, 1e-5)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        tied_output="output" not in weights,
        rope_scaling=_rope_scaling(path, meta, n_ctx_train),
        extra=extra,
    )
    for k, v in (("dim", cfg.dim), ("n_layers", cfg.n_layers), ("n_heads", cfg.n_heads),
                 ("n_kv_heads", cfg.n_kv_heads), ("hidden_dim", cfg.hidden_dim), ("head_dim", cfg.head_dim)):
        if not 0 < v <= 1 << 20:
            raise ModelError(f"{path}: metadata {k} = {v} is out of range")
    if cfg.n_heads % cfg.n_kv_heads:
        raise ModelError(f"{path}: head_count {cfg.n_heads} is not a multiple of head_count_kv {cfg.n_kv_heads}")
    if spec.partial_rotary and not (0 < rope_dims <= head_dim and rope_dims % 2 == 0):
        raise ModelError(f"{path}: metadata {arch}.rope.dimension_count = {rope_dims}: not an even number of "
                         f"dimensions within a head of {head_dim}")
    checks = [("attention.value_length", cfg.head_dim, "value heads of another size than the keys'"),
              ("vocab_size", vocab, "a vocabulary of another size than the embedding's rows")]
    if not spec.partial_rotary and spec.rope_style != "learned":
        checks.insert(0, ("rope.dimension_count", cfg.head_dim, "partial rotary embeddings (only some dims of "
                                                                "each head rotate)"))
    for key, want, what in checks:
        got = meta(key)
        if got is not None and int(got) != want:
            raise ModelError(f"{path}: metadata {arch}.{key} = {int(got)}, not {want}: {what}; lmc does not "
                             f"implement that")
    bos = md.get("tokenizer.ggml.bos_token_id")
    eos = md.get("tokenizer.ggml.eos_token_id")
    if bos is not None:
        cfg.bos_id = int(bos)
    if eos is not None:
        cfg.eos_id = int(eos)
    cfg.stop_ids = (cfg.eos_id,)
    weights = split_fused(cfg, weights, path)
    check_weights(cfg, weights, path)
    return GGUFModel(path, cfg, weights, md)
