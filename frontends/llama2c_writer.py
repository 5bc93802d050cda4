"""Write llama2.c checkpoints (v0, v1, v2) in the byte order run.c and runq.c read.

Used to make synthetic models of real shapes and to test the reader on every
version; the layout here mirrors ``llama2c.load_llama2c`` exactly.
"""
from __future__ import annotations

import os
import struct
from typing import BinaryIO

import numpy as np

from .arch import ModelConfig
from .llama2c import MAGIC, V1_HEADER

_ATTN = ("attn_q", "attn_k", "attn_v", "attn_output")
_FFN = ("ffn_gate", "ffn_down", "ffn_up")


def quantize_q8(w: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """export.py's quantize_q80: symmetric int8 per group, scale = max|w|/127."""
    g = np.asarray(w, np.float32).reshape(-1, group)
    scale = (np.abs(g).max(axis=1) / np.float32(127.0)).astype(np.float32)
    safe = np.where(scale == 0, np.float32(1.0), scale)
    q = np.round(g / safe[:, None]).astype(np.int8)
    return q.reshape(-1), scale


def _f32(f: BinaryIO, a: np.ndarray) -> None:
    f.write(np.ascontiguousarray(a, dtype="<f4").tobytes())


def write_llama2c(path: str | os.PathLike, cfg: ModelConfig, t: dict[str, np.ndarray], version: int = 0,
                  group_size: int = 64) -> None:
    """``t`` maps GGUF-style names (token_embd, blk.N.attn_q ...) to arrays."""
    L = cfg.n_layers
    vocab = cfg.vocab_size if cfg.tied_output or version else -cfg.vocab_size
    params = (cfg.dim, cfg.hidden_dim, L, cfg.n_heads, cfg.n_kv_heads, vocab, cfg.seq_len)
    tmp = os.fspath(path) + ".part"
    with open(tmp, "wb") as f:
        if version == 0:
            f.write(struct.pack("<7i", *params))
            _f32(f, t["token_embd"])
            for n in ("attn_norm",) + _ATTN + ("ffn_norm",) + _FFN:
                for i in range(L):
                    _f32(f, t[f"blk.{i}.{n}"])
            _f32(f, t["output_norm"])
            hs = cfg.head_dim
            _f32(f, np.zeros(cfg.seq_len * hs // 2 * 2, np.float32))
            if not cfg.tied_output:
                _f32(f, t["output"])
        else:
            head = struct.pack("<Ii7iB", MAGIC, version, *params, int(cfg.tied_output))
            if version == 2:
                head += struct.pack("<i", group_size)
            f.write(head + b"\0" * (V1_HEADER - len(head)))
            for n in ("attn_norm", "ffn_norm"):
                for i in range(L):
                    _f32(f, t[f"blk.{i}.{n}"])
            _f32(f, t["output_norm"])
            mats = ["token_embd"] + [f"blk.{i}.{n}" for n in _ATTN + _FFN for i in range(L)]
            if not cfg.tied_output:
                mats.append("output")
            for name in mats:
                if version == 1:
                    _f32(f, t[name])
                else:
                    q, s = quantize_q8(t[name], group_size)
                    f.write(q.tobytes())
                    _f32(f, s)
    os.replace(tmp, path)
