"""Synthetic llama2.c checkpoints of real shapes, for benchmarks.

Random weights stand in for trained ones: speed depends on shapes and bytes,
not on values, so a seeded random stories110M or llama2-7b measures what the
real file would, without downloading it. The file is written one tensor at a
time (a llama2-7b fp32 file is ~27 GB), so memory stays near one tensor.
"""
from __future__ import annotations

import os
import shutil
import struct
import sys
import time
from typing import Callable

import numpy as np

from .arch import ModelConfig, expected_shapes
from .llama2c_writer import llama2c_nbytes, tensor_order, write_llama2c
from .output_file import write_atomic

#: (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len, tied output)
_SHAPES = {
    "stories15M": (288, 768, 6, 6, 6, 32000, 256, True),
    "stories42M": (512, 1376, 8, 8, 8, 32000, 1024, True),
    "stories110M": (768, 2048, 12, 12, 12, 32000, 1024, True),
    "llama2-7b": (4096, 11008, 32, 32, 32, 32000, 4096, False),
}


def shape_config(name: str) -> ModelConfig:
    """The ModelConfig of a named shape (as llama2.c's header would give it)."""
    try:
        d, h, L, nh, nkv, v, ctx, tied = _SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown model shape {name!r} (known: {', '.join(_SHAPES)})") from None
    return ModelConfig(arch="llama", dim=d, hidden_dim=h, n_layers=L, n_heads=nh, n_kv_heads=nkv,
                       vocab_size=v, seq_len=ctx, tied_output=tied)


SHAPES: dict[str, ModelConfig] = {name: shape_config(name) for name in _SHAPES}

#: standard deviation of every matrix and of the embedding table. With a
#: pre-norm residual stream, a projection of fan-in n gives outputs of rms
#: ~0.02*sqrt(n) (1.3 at 4096, 2.1 at 11008): activations grow slowly with
#: depth and stay far from overflow; logits stay small (a near-flat softmax).
WEIGHT_STD = 0.02


def synth_tensor(cfg: ModelConfig, name: str, seed: int = 0) -> np.ndarray:
    """One tensor, reproducible on its own: its generator is seeded by
    (seed, the tensor's index in ``expected_shapes``), so any tensor can be
    rebuilt without generating the ones before it."""
    shapes = expected_shapes(cfg)
    shape = shapes[name]
    if len(shape) == 1:  # norm weights
        return np.ones(shape, np.float32)
    index = list(shapes).index(name)
    rng = np.random.default_rng([seed, index])
    a = rng.standard_normal(shape, dtype=np.float32)
    a *= np.float32(WEIGHT_STD)
    return a


def _progress_line(label: str) -> Callable[[int, int], None] | None:
    """A percentage line on stderr, only when stderr is a terminal."""
    if not sys.stderr.isatty():
        return None
    t0 = time.perf_counter()
    last = [-1]

    def show(done: int, total: int) -> None:
        pct = int(100 * done / max(total, 1))
        if pct == last[0]:
            return
        last[0] = pct
        secs = time.perf_counter() - t0
        end = "\n" if done >= total else ""
        sys.stderr.write(f"\r{label}: {pct:3d}% ({done / 1e9:.2f} of {total / 1e9:.2f} GB, {secs:.0f}s)" + end)
        sys.stderr.flush()

    return show


def synth_llama2c(shape: str | ModelConfig, path: str | os.PathLike, seed: int = 0, version: int = 0,
                  group_size: int = 64) -> None:
    """Write a random llama2.c checkpoint of a named shape (see ``SHAPES``)
    to ``path``. A ``ModelConfig`` may stand in for the name (tests use tiny
    ones). Same arguments, same bytes."""
    cfg = shape if isinstance(shape, ModelConfig) else shape_config(shape)
    if version not in (0, 1, 2):
        raise ValueError(f"unknown llama2.c version {version} (0, 1 or 2)")
    if version == 2:
        for name in tensor_order(cfg, version):
            n = int(np.prod(expected_shapes(cfg)[name]))
            if len(expected_shapes(cfg)[name]) == 2 and n % group_size:
                raise ValueError(f"{name}: {n} values is not a multiple of the group size {group_size}")
    path = os.fspath(path)
    need = llama2c_nbytes(cfg, version, group_size)
    folder = os.path.dirname(os.path.abspath(path))
    free = shutil.disk_usage(folder).free
    if need > free:
        raise OSError(28, f"{path}: needs {need / 1e9:.2f} GB, the disk has {free / 1e9:.2f} GB free")
    label = f"synth {shape if isinstance(shape, str) else 'model'} v{version}"
    write_llama2c(path, cfg, lambda name: synth_tensor(cfg, name, seed), version=version,
                  group_size=group_size, progress=_progress_line(label))


def write_synth_tokenizer(path: str | os.PathLike, vocab_size: int) -> None:
    """A valid llama2.c tokenizer.bin for ``vocab_size`` pieces: <unk>, BOS,
    EOS, then byte pieces <0x00>..<0xFF> (when the vocabulary has room),
    then " " and distinct filler pieces. Enough to load and run a synthetic
    model; the text it decodes to means nothing."""
    pieces: list[bytes] = [b"<unk>", b"\n<s>\n", b"\n</s>\n"]
    if vocab_size >= 259:
        pieces += [f"<0x{b:02X}>".encode() for b in range(256)]
    if len(pieces) < vocab_size:
        pieces.append(b" ")
    k = 0
    while len(pieces) < vocab_size:
        pieces.append(f"t{k}".encode())
        k += 1
    pieces = pieces[:vocab_size]
    out = [struct.pack("<i", max(len(p) for p in pieces))]
    for i, p in enumerate(pieces):
        score = 0.0 if i < 3 else -float(i)
        out.append(struct.pack("<fi", score, len(p)) + p)
    write_atomic(path, b"".join(out))
