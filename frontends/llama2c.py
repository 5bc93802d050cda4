"""llama2.c checkpoints: every format run.c and runq.c read.

- v0 (legacy): seven int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads,
  vocab_size, seq_len); a negative vocab_size means a separate classifier
  follows the weights. fp32, with the unused RoPE tables in the middle.
- v1: uint32 magic "ak42", int32 version 1, the seven ints, a shared-classifier
  byte, zero padding to 256 bytes; fp32 weights in export.py's order.
- v2: as v1 with version 2 and an int32 group size after the flag byte; norms
  stay fp32, every matrix is Q8_0 (int8 values, then fp32 scales per group).

Weights become references into the file (nothing is read but the header), and
every offset is checked against the file size here, before anything reads it.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass

from ir.graph import WeightRef
from ir.quant import get_layout, planar_q8
from ir.types import TensorType

from .arch import ModelConfig, ModelError, WeightInfo, check_weights

MAGIC = 0x616B3432  # "ak42"
V1_HEADER = 256
# Sanity caps: far above any llama2.c model, low enough that a corrupt header
# cannot make us compute absurd sizes.
_MAX = {"dim": 1 << 16, "hidden_dim": 1 << 18, "n_layers": 1 << 10, "n_heads": 1 << 10,
        "vocab_size": 1 << 22, "seq_len": 1 << 20}


@dataclass
class Llama2cCheckpoint:
    path: str
    version: int
    config: ModelConfig
    weights: dict[str, WeightInfo]
    group_size: int = 0


def is_llama2c(path: str) -> bool:
    """A .bin that is not GGUF; v1/v2 by magic, v0 has none (so: by suffix)."""
    with open(path, "rb") as f:
        head = f.read(4)
    if head == b"GGUF":
        return False
    return len(head) == 4 and (struct.unpack("<I", head)[0] == MAGIC or path.endswith(".bin"))


def _config(path: str, vals: tuple[int, ...]) -> tuple[ModelConfig, bool]:
    names = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len")
    d = dict(zip(names, vals))
    separate = d["vocab_size"] < 0
    d["vocab_size"] = abs(d["vocab_size"])
    for k, v in d.items():
        cap = _MAX.get(k, 1 << 10)
        if not 0 < v <= cap:
            raise ModelError(f"{path}: header field {k} = {v} is out of range (1..{cap}); not a llama2.c checkpoint?")
    if d["dim"] % d["n_heads"]:
        raise ModelError(f"{path}: dim {d['dim']} is not a multiple of n_heads {d['n_heads']}")
    if d["n_heads"] % d["n_kv_heads"]:
        raise ModelError(f"{path}: n_heads {d['n_heads']} is not a multiple of n_kv_heads {d['n_kv_heads']}")
    if (d["dim"] // d["n_heads"]) % 2:
        raise ModelError(f"{path}: head size {d['dim'] // d['n_heads']} is odd; RoPE needs pairs")
    cfg = ModelConfig(arch="llama", norm_eps=1e-5, rope_theta=10000.0, tied_output=not separate,
                      bos_id=1, eos_id=2, stop_ids=(1,), **d)
    return cfg, separate


class _Layout:
    """Hands out consecutive tensors from an offset, checking the file size."""

    def __init__(self, path: str, offset: int, size: int) -> None:
        self.path, self.offset, self.size = path, offset, size
        self.weights: dict[str, WeightInfo] = {}

    def take(self, name: str | None, shape: tuple[int, ...], layout: str = "F32") -> None:
        t = TensorType(shape, "f32", layout)
        n = get_layout(layout).nbytes(shape)
        if self.offset + n > self.size:
            raise ModelError(f"{self.path}: truncated: tensor {name or 'rope tables'} needs bytes "
                             f"{self.offset}..{self.offset + n}, the file has {self.size}")
        if name is not None:
            self.weights[name] = WeightInfo(t, WeightRef(self.path, self.offset, n))
        self.offset += n

    def per_layer(self, fmt: str, n_layers: int, shape: tuple[int, ...], layout: str = "F32") -> None:
        for i in range(n_layers):
            self.take(fmt.format(i), shape, layout)

    def finish(self) -> None:
        if self.offset != self.size:
            raise ModelError(f"{self.path}: the header implies {self.offset} bytes, the file has {self.size}")


def load_llama2c(path: str | os.PathLike) -> Llama2cCheckpoint:
    """Read the header and map out every tensor; raise ModelError on any misfit."""
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(V1_HEADER)
    except OSError as e:
        raise ModelError(f"{path}: cannot read: {e.strerror}") from None
    if len(head) < 28:
        raise ModelError(f"{path}: truncated: {len(head)} bytes is shorter than any llama2.c header")
    magic = struct.unpack_from("<I", head)[0]
    group = 0
    if magic == MAGIC:
        if len(head) < V1_HEADER:
            raise ModelError(f"{path}: truncated header ({len(head)} of {V1_HEADER} bytes)")
        version = struct.unpack_from("<i", head, 4)[0]
        if version not in (1, 2):
            raise ModelError(f"{path}: unknown llama2.c checkpoint version {version} (lmc reads 0, 1 and 2)")
        cfg, _ = _config(path, struct.unpack_from("<7i", head, 8))
        cfg.tied_output = bool(head[36])
        if version == 2:
            group = struct.unpack_from("<i", head, 37)[0]
            if not 0 < group <= 4096:
                raise ModelError(f"{path}: group size {group} is out of range")
        lay = _Layout(path, V1_HEADER, size)
    else:
        version = 0
        cfg, _ = _config(path, struct.unpack_from("<7i", head, 0))
        lay = _Layout(path, 28, size)

    L, dim, hid, hs = cfg.n_layers, cfg.dim, cfg.hidden_dim, cfg.head_dim
    mats = [("blk.{}.attn_q", (cfg.q_dim, dim)), ("blk.{}.attn_k", (cfg.kv_dim, dim)),
            ("blk.{}.attn_v", (cfg.kv_dim, dim)), ("blk.{}.attn_output", (dim, cfg.q_dim)),
            ("blk.{}.ffn_gate", (hid, dim)), ("blk.{}.ffn_down", (dim, hid)),
            ("blk.{}.ffn_up", (hid, dim))]
    if version == 0:
        lay.take("token_embd", (cfg.vocab_size, dim))
        lay.per_layer("blk.{}.attn_norm", L, (dim,))
        for fmt, shape in mats[:4]:
            lay.per_layer(fmt, L, shape)
        lay.per_layer("blk.{}.ffn_norm", L, (dim,))
        for fmt, shape in mats[4:]:
            lay.per_layer(fmt, L, shape)
        lay.take("output_norm", (dim,))
        lay.take(None, (cfg.seq_len * hs // 2 * 2,))  # freq_cis_real and _imag, unused
        if not cfg.tied_output:
            lay.take("output", (cfg.vocab_size, dim))
    else:
        lay.per_layer("blk.{}.attn_norm", L, (dim,))
        lay.per_layer("blk.{}.ffn_norm", L, (dim,))
        lay.take("output_norm", (dim,))
        layout = "F32" if version == 1 else planar_q8(group)
        if version == 2:
            for fmt, shape in [("token_embd", (cfg.vocab_size, dim))] + mats:
                n = shape[0] * shape[1]
                if n % group:
                    raise ModelError(f"{path}: tensor {fmt.format('N')} ({n} values) is not a multiple "
                                     f"of the group size {group}")
        lay.take("token_embd", (cfg.vocab_size, dim), layout)
        for fmt, shape in mats:
            lay.per_layer(fmt, L, shape, layout)
        if not cfg.tied_output:
            lay.take("output", (cfg.vocab_size, dim), layout)
    lay.finish()
    check_weights(cfg, lay.weights, path)
    return Llama2cCheckpoint(path, version, cfg, lay.weights, group)
