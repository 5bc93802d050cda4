"""Write GGUF files (llama-style families) with the ``gguf`` package's writer.

Used by ``lmc synth --format gguf``: a synthetic model of a real shape, its
matrices quantized to the chosen type, norms in F32, and a small
SentencePiece-style vocabulary so that the file loads like any other GGUF.
Tensors are written one at a time (a llama2-7b Q4_0 file is ~3.8 GB).
"""
from __future__ import annotations

import os
from typing import Callable

import numpy as np

from .arch import ModelConfig, expected_shapes
from .quantize import quantize

QTYPES = ("F32", "Q8_0", "Q4_0", "Q4_K")
#: as llama.cpp's quantizer does: a K-quant needs rows of a multiple of 256
#: values; other rows fall back to this type
K_FALLBACK = {"Q4_K": "Q5_0"}


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


def write_gguf(path: str | os.PathLike, cfg: ModelConfig, tensor: Callable[[str], np.ndarray],
               qtype: str = "Q8_0", name: str = "synth") -> None:
    """Write ``cfg``'s tensors (``tensor(name)`` gives each as float32) to a
    llama GGUF; matrices in ``qtype``, vectors in F32. Atomic: a temp file is
    renamed into place only when complete."""
    import gguf

    if qtype not in QTYPES:
        raise ValueError(f"--qtype {qtype}: choose one of {', '.join(QTYPES)}")
    path = os.fspath(path)
    tmp = f"{path}.{os.getpid()}.part"
    w = gguf.GGUFWriter(tmp, cfg.arch)  # metadata keys are "<arch>.*"
    try:
        w.add_name(name)
        w.add_context_length(cfg.seq_len)
        w.add_embedding_length(cfg.dim)
        w.add_block_count(cfg.n_layers)
        w.add_feed_forward_length(cfg.hidden_dim)
        w.add_head_count(cfg.n_heads)
        w.add_head_count_kv(cfg.n_kv_heads)
        w.add_layer_norm_rms_eps(cfg.norm_eps)
        w.add_rope_freq_base(cfg.rope_theta)
        w.add_file_type(gguf.LlamaFileType.ALL_F32 if qtype == "F32" else gguf.LlamaFileType.GUESSED)
        toks, scores, types = synth_vocab(cfg.vocab_size)
        w.add_tokenizer_model("llama")
        w.add_token_list(toks)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_bos_token(True)
        shapes = expected_shapes(cfg)
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
        w.close()
        os.replace(tmp, path)
    except BaseException:
        w.close()
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
