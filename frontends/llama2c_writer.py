"""Write llama2.c checkpoints (v0, v1, v2) in the byte order run.c and runq.c read.

Used to make synthetic models of real shapes and to test the reader on every
version; the layout here mirrors ``llama2c.load_llama2c`` exactly.
"""
from __future__ import annotations

import os
import struct
from typing import BinaryIO, Callable, Mapping, Union

import numpy as np

from .arch import ModelConfig, expected_shapes
from .llama2c import MAGIC, V1_HEADER
from .output_file import atomic_output

_ATTN = ("attn_q", "attn_k", "attn_v", "attn_output")
_FFN = ("ffn_gate", "ffn_down", "ffn_up")


def quantize_q8(w: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """export.py's quantize_q80: symmetric int8 per group, scale = max|w|/127."""
    g = np.asarray(w, np.float32).reshape(-1, group)
    scale = (np.abs(g).max(axis=1) / np.float32(127.0)).astype(np.float32)
    safe = np.where(scale == 0, np.float32(1.0), scale)
    q = np.round(g / safe[:, None]).astype(np.int8)
    return q.reshape(-1), scale


def _f32(f: BinaryIO, a: np.ndarray) -> int:
    a = np.ascontiguousarray(a, dtype="<f4")
    f.write(memoryview(a).cast("B"))  # no tobytes() copy: 7B tensors are large
    return a.nbytes


#: tensors quantized per slice of this many values, so a q8 export of a big
#: matrix never holds more than a few temporaries of this size beside it
_Q8_SLICE = 1 << 22


def _q8(f: BinaryIO, w: np.ndarray, group: int) -> int:
    """quantize_q8 written as int8 values then fp32 scales, in slices."""
    flat = np.ascontiguousarray(w, np.float32).reshape(-1)
    if flat.size % group:
        raise ValueError(f"a tensor of {flat.size} values is not a multiple of the group size {group}")
    step = max(group, _Q8_SLICE // group * group)
    scales = []
    for lo in range(0, flat.size, step):
        q, s = quantize_q8(flat[lo: lo + step], group)
        f.write(memoryview(q).cast("B"))
        scales.append(s)
    n = flat.size
    for s in scales:
        _f32(f, s)
    return n + n // group * 4


Tensors = Union[Mapping[str, np.ndarray], Callable[[str], np.ndarray]]


def tensor_order(cfg: ModelConfig, version: int) -> list[str]:
    """Names in the order the file stores them (v0's unused RoPE tables,
    which sit before ``output``, are not tensors)."""
    L = cfg.n_layers
    if version == 0:
        names = ["token_embd"]
        for n in ("attn_norm",) + _ATTN + ("ffn_norm",) + _FFN:
            names += [f"blk.{i}.{n}" for i in range(L)]
        names.append("output_norm")
    else:
        names = [f"blk.{i}.{n}" for n in ("attn_norm", "ffn_norm") for i in range(L)] + ["output_norm"]
        names += ["token_embd"] + [f"blk.{i}.{n}" for n in _ATTN + _FFN for i in range(L)]
    if not cfg.tied_output:
        names.append("output")
    return names


def llama2c_nbytes(cfg: ModelConfig, version: int = 0, group_size: int = 64) -> int:
    """The size of the file ``write_llama2c`` makes, without making it."""
    shapes = expected_shapes(cfg)
    total = 28 if version == 0 else V1_HEADER
    for name in tensor_order(cfg, version):
        n = int(np.prod(shapes[name]))
        total += n + n // group_size * 4 if version == 2 and len(shapes[name]) == 2 else 4 * n
    if version == 0:
        total += 4 * (cfg.seq_len * cfg.head_dim // 2 * 2)
    return total


def write_llama2c(path: str | os.PathLike, cfg: ModelConfig, t: Tensors, version: int = 0,
                  group_size: int = 64, progress: Callable[[int, int], None] | None = None) -> None:
    """``t`` maps GGUF-style names (token_embd, blk.N.attn_q ...) to arrays, or
    is a callable ``name -> array`` asked for each tensor in file order, so a
    model far larger than memory can be written one tensor at a time.

    The file appears at ``path`` only once complete (temporary file in the
    same folder, then an atomic rename); on any error the partial file is
    removed. ``progress(done_bytes, total_bytes)`` is called after each tensor.
    """
    if version not in (0, 1, 2):
        raise ValueError(f"unknown llama2.c version {version} (0, 1 or 2)")
    get = t if callable(t) else t.__getitem__
    shapes = expected_shapes(cfg)
    total = llama2c_nbytes(cfg, version, group_size)
    L = cfg.n_layers
    vocab = cfg.vocab_size if cfg.tied_output or version else -cfg.vocab_size
    params = (cfg.dim, cfg.hidden_dim, L, cfg.n_heads, cfg.n_kv_heads, vocab, cfg.seq_len)
    done = 0

    def put(f: BinaryIO, name: str) -> None:
        nonlocal done
        a = np.asarray(get(name))
        if a.shape != shapes[name] and a.size != int(np.prod(shapes[name])):
            raise ValueError(f"tensor {name} has shape {a.shape}, the config needs {shapes[name]}")
        if version == 2 and len(shapes[name]) == 2:
            done += _q8(f, a, group_size)
        else:
            done += _f32(f, a)
        del a
        if progress is not None:
            progress(done, total)

    with atomic_output(path) as f:   # a temporary file beside the target, renamed once complete
        if version == 0:
            head = struct.pack("<7i", *params)
        else:
            head = struct.pack("<Ii7iB", MAGIC, version, *params, int(cfg.tied_output))
            if version == 2:
                head += struct.pack("<i", group_size)
            head += b"\0" * (V1_HEADER - len(head))
        f.write(head)
        done = len(head)
        for name in tensor_order(cfg, version):
            if name == "output" and version == 0:
                done += _f32(f, np.zeros(cfg.seq_len * cfg.head_dim // 2 * 2, np.float32))
            put(f, name)
        if version == 0 and cfg.tied_output:
            done += _f32(f, np.zeros(cfg.seq_len * cfg.head_dim // 2 * 2, np.float32))
        if done != total:
            raise AssertionError(f"wrote {done} bytes, expected {total}")
