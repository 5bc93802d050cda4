"""Write GGUF files (llama-style families) with the ``gguf`` package's writer.

Used by ``lmc synth --format gguf``: a synthetic model of a real shape, its
matrices quantized to the chosen type, norms in F32, and a small
SentencePiece-style vocabulary so that the file loads like any other GGUF.
Tensors are written one at a time (a llama2-7b Q4_0 file is ~3.8 GB).
"""
from __future__ import annotations

import os
from typing import Any, Callable, Iterable

import numpy as np

from .arch import ModelConfig, file_shapes, optional_shapes
from .output_file import atomic_path
from .quantize import quantize

QTYPES = ("F32", "Q8_0", "Q4_0", "Q2_K", "Q3_K", "Q4_K", "TQ1_0", "TQ2_0", "IQ4_NL", "IQ4_XS", "MXFP4")
#: as llama.cpp's quantizer does: a K-quant (ternary type, IQ4_XS) needs rows of a
#: multiple of 256 values; other rows fall back to this type (Q2_K / Q3_K:
#: Q4_0, as before llama.cpp had IQ4_NL; TQ1_0 / TQ2_0: Q4_0, as llama.cpp does)
K_FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "TQ1_0": "Q4_0", "TQ2_0": "Q4_0",
              "IQ4_XS": "IQ4_NL"}


def tensor_qtype(shape: tuple[int, ...], qtype: str) -> str:
    """The type a tensor of ``shape`` is stored in when ``qtype`` is asked for."""
    if len(shape) != 2:
        return "F32"  # norms and biases
    if qtype in K_FALLBACK and shape[-1] % 256:
        return K_FALLBACK[qtype]
    return qtype


def synth_vocab(vocab_size: int) -> tuple[list[bytes], list[float], list[int]]:
    """<unk>, <s>, </s>, 256 byte tokens, then '▁' and filler pieces."""
    from gguf import TokenType

    toks = [b"<unk>", b"<s>", b"</s>"]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    for b in range(256):
        toks.append(f"<0x{b:02X}>".encode())
        types.append(TokenType.BYTE)
    letters = "abcdefghijklmnopqrstuvwxyz"
    k = 0
    while len(toks) < vocab_size:
        piece = "\u2581" if k == 0 else ("\u2581" if k % 2 else "") + letters[k % 26] + letters[(k // 26) % 26] + str(k)
        toks.append(piece.encode())
        types.append(TokenType.NORMAL)
        k += 1
    toks, types = toks[:vocab_size], types[:vocab_size]
    scores = [0.0 if i < 259 else -float(i) for i in range(len(toks))]
    return toks, scores, [int(t) for t in types]


def _tensor_name(n: str) -> str:
    return n if n.endswith(".bias") else n + ".weight"


def add_value(w: Any, key: str, value: Any) -> None:
    """One metadata key, typed by its Python value (the types GGUF files use)."""
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value) if value >= 0 else w.add_int32(key, value)
    else:
        raise TypeError(f"metadata {key}: cannot write a {type(value).__name__}")


def family_metadata(cfg: ModelConfig) -> dict[str, Any]:
    """The ``{arch}.*`` keys llama.cpp's converter writes for ``cfg``, so
    that lmc and llama.cpp read the same model from the file."""
    a, spec = cfg.arch, cfg.spec
    eps = "layer_norm_epsilon" if spec.norm == "layer" else "layer_norm_rms_epsilon"
    md: dict[str, Any] = {
        f"{a}.context_length": int(cfg.seq_len), f"{a}.embedding_length": int(cfg.dim),
        f"{a}.block_count": int(cfg.n_layers), f"{a}.feed_forward_length": int(cfg.hidden_dim),
        f"{a}.attention.head_count": int(cfg.n_heads), f"{a}.attention.head_count_kv": int(cfg.n_kv_heads),
        f"{a}.attention.{eps}": float(cfg.norm_eps),
    }
    if spec.rope_style != "learned":
        md[f"{a}.rope.freq_base"] = float(cfg.rope_theta)
        md[f"{a}.rope.dimension_count"] = int(cfg.rope_dims)
    if cfg.head_dim != cfg.dim // cfg.n_heads:
        md[f"{a}.attention.key_length"] = md[f"{a}.attention.value_length"] = int(cfg.head_dim)
    if spec.swa_every:
        md[f"{a}.attention.sliding_window"] = int(cfg.extra.get("sliding_window", spec.default_window))
    if spec.softcap:
        md[f"{a}.attn_logit_softcapping"] = float(cfg.extra.get("attn_softcap", 50.0))
        md[f"{a}.final_logit_softcapping"] = float(cfg.extra.get("final_softcap", 30.0))
    rs = cfg.rope_scaling
    if rs.kind != "none":
        md[f"{a}.rope.scaling.type"] = rs.kind
        md[f"{a}.rope.scaling.factor"] = float(rs.factor)
        if rs.kind == "yarn":
            md[f"{a}.rope.scaling.original_context_length"] = int(rs.orig_ctx)
    if rs.attn_factor != 1.0:
        md[f"{a}.rope.scaling.attn_factor"] = float(rs.attn_factor)
    return md


def write_gguf(path: str | os.PathLike, cfg: ModelConfig, tensor: Callable[[str], np.ndarray],
               qtype: str = "Q8_0", name: str = "synth", metadata: dict[str, Any] | None = None,
               extra_tensors: Iterable[str] = (),
               vocab: tuple[list[bytes], list[float], list[int]] | None = None) -> None:
    """Write ``cfg``'s tensors (``tensor(name)`` gives each as float32) to a
    GGUF of its family as llama.cpp's converter lays it out (``file_shapes``:
    fused tensors where the family fuses), with its metadata keys (``family_metadata``)
    and ``metadata`` on top; matrices in ``qtype``, vectors in F32.
    ``extra_tensors`` names optional tensors to include (``rope_freqs``,
    biases: ``frontends.arch.optional_shapes``). Atomic: a temp file is
    renamed into place only when complete. ``vocab``: (pieces, scores,
    token types) of an SPM vocabulary; default ``synth_vocab``."""
    import gguf

    if qtype not in QTYPES:
        raise ValueError(f"--qtype {qtype}: choose one of {', '.join(QTYPES)}")
    with atomic_path(path) as tmp:   # a temporary file beside the target, renamed once complete
        w = gguf.GGUFWriter(tmp, cfg.arch)  # metadata keys are "<arch>.*"
        try:
            w.add_name(name)
            for key, value in {**family_metadata(cfg), **(metadata or {})}.items():
                add_value(w, key, value)
            w.add_file_type(gguf.LlamaFileType.ALL_F32 if qtype == "F32" else gguf.LlamaFileType.GUESSED)
            toks, scores, types = vocab or synth_vocab(cfg.vocab_size)
            w.add_tokenizer_model("llama")
            w.add_token_list(toks)
            w.add_token_scores(scores)
            w.add_token_types(types)
            w.add_bos_token_id(1)
            w.add_eos_token_id(2)
            w.add_unk_token_id(0)
            w.add_add_bos_token(True)
            shapes = file_shapes(cfg)
            optional = optional_shapes(cfg)
            for n in extra_tensors:
                if n not in optional:
                    raise ValueError(f"{n} is not an optional tensor of the {cfg.arch} family")
                shapes[n] = optional[n]
            order = list(shapes)

            for n in order:  # tensor infos first (shapes and sizes), data after
                shape = shapes[n]
                t = tensor_qtype(shape, qtype)
                qt = gguf.GGMLQuantizationType[t]
                bs, ts = gguf.GGML_QUANT_SIZES[qt]
                nbytes = int(np.prod(shape[:-1])) * shape[-1] // bs * ts
                # quantized tensors are described by their byte shape (rows, row bytes)
                byte_shape = list(shape) if t == "F32" else list(shape[:-1]) + [shape[-1] // bs * ts]
                w.add_tensor_info(_tensor_name(n), byte_shape, np.dtype(np.float32 if t == "F32" else np.uint8), nbytes,
                                  raw_dtype=None if t == "F32" else qt)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            for n in order:
                data = quantize(tensor(n), tensor_qtype(shapes[n], qtype))
                w.write_tensor_data(np.ascontiguousarray(data))
        finally:
            w.close()
