"""The llama2.c checkpoint reader: every version, and every bad input."""
from __future__ import annotations

import shutil
import struct

import numpy as np
import pytest

from frontends.arch import ModelConfig, ModelError
from frontends.llama2c import load_llama2c
from frontends.llama2c_writer import write_llama2c
from ir.interp import WeightStore

from shared_data import MODELS, needs_shared


def tensors_of(path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    ck = load_llama2c(path)
    ws = WeightStore()
    from ir.ops import WeightData

    return ck.config, {k: WeightData(ws.raw(w.ref), w.type).to_f32() for k, w in ck.weights.items()}


def tiny_config(**kw) -> ModelConfig:
    base = dict(arch="llama", dim=16, hidden_dim=24, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=32,
                seq_len=8)
    base.update(kw)
    return ModelConfig(**base)


def random_tensors(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    from frontends.arch import expected_shapes

    r = np.random.default_rng(seed)
    return {k: r.standard_normal(s).astype(np.float32) * 0.3 for k, s in expected_shapes(cfg).items()}


@pytest.mark.parametrize("version", [0, 1, 2])
@pytest.mark.parametrize("tied", [True, False])
def test_every_version_round_trips(tmp_path, version, tied):
    cfg = tiny_config(tied_output=tied)
    t = random_tensors(cfg)
    p = tmp_path / f"m{version}.bin"
    write_llama2c(p, cfg, t, version=version, group_size=8)
    ck = load_llama2c(p)
    assert ck.version == version
    assert ck.config.tied_output == tied
    assert (ck.config.dim, ck.config.vocab_size, ck.config.n_kv_heads) == (16, 32, 2)
    _, back = tensors_of(p)
    assert set(back) == set(t)
    for k in t:
        tol = 0 if version < 2 else np.abs(t[k]).max() / 127 * 0.51
        assert np.abs(back[k] - t[k]).max() <= tol + 1e-7, k


@needs_shared
def test_real_checkpoints_load():
    v0 = load_llama2c(MODELS / "stories260K.bin")
    assert v0.version == 0 and v0.config.n_kv_heads == 4 and v0.config.tied_output
    v2 = load_llama2c(MODELS / "stories260K-q8.bin")
    assert v2.version == 2 and v2.group_size == 8
    _, a = tensors_of(MODELS / "stories260K.bin")
    _, b = tensors_of(MODELS / "stories260K-q8.bin")
    # the q8 file holds the same weights, quantized in groups of 8
    for k in ("token_embd", "blk.3.ffn_down", "output_norm"):
        assert np.abs(a[k] - b[k]).max() < 0.01


def write_bytes(tmp_path, name, data: bytes):
    p = tmp_path / name
    p.write_bytes(data)
    return p


def test_bad_inputs(tmp_path):
    cfg = tiny_config()
    good = tmp_path / "good.bin"
    write_llama2c(good, cfg, random_tensors(cfg), version=0)
    data = good.read_bytes()

    def err(path) -> str:
        with pytest.raises(ModelError) as e:
            load_llama2c(path)
        msg = str(e.value)
        assert "\n" not in msg and str(path) in msg
        return msg

    assert "no such file" in err(tmp_path / "missing.bin") or "cannot read" in err(tmp_path / "missing.bin")
    assert "truncated" in err(write_bytes(tmp_path, "short.bin", data[:10]))
    assert "truncated" in err(write_bytes(tmp_path, "cut.bin", data[: len(data) // 2]))
    assert "the header implies" in err(write_bytes(tmp_path, "long.bin", data + b"\0" * 8))
    bad_dim = struct.pack("<7i", 16, 24, 2, 3, 2, 32, 8) + data[28:]
    assert "not a multiple" in err(write_bytes(tmp_path, "heads.bin", bad_dim))
    absurd = struct.pack("<7i", 1 << 30, 24, 2, 4, 2, 32, 8) + data[28:]
    assert "out of range" in err(write_bytes(tmp_path, "absurd.bin", absurd))
    zero = struct.pack("<7i", 16, 24, 0, 4, 2, 32, 8) + data[28:]
    assert "out of range" in err(write_bytes(tmp_path, "zero.bin", zero))
    v1 = tmp_path / "v1.bin"
    write_llama2c(v1, cfg, random_tensors(cfg), version=1)
    raw = bytearray(v1.read_bytes())
    raw[4:8] = struct.pack("<i", 7)
    assert "unknown llama2.c checkpoint version 7" in err(write_bytes(tmp_path, "v7.bin", bytes(raw)))
    v2 = tmp_path / "v2.bin"
    write_llama2c(v2, cfg, random_tensors(cfg), version=2, group_size=8)
    raw = bytearray(v2.read_bytes())
    raw[37:41] = struct.pack("<i", 0)
    assert "group size" in err(write_bytes(tmp_path, "g0.bin", bytes(raw)))
    assert "truncated" in err(write_bytes(tmp_path, "v2cut.bin", v2.read_bytes()[:-3]))


@needs_shared
def test_truncated_real_model(tmp_path):
    p = tmp_path / "stories260K.bin"
    shutil.copy(MODELS / "stories260K.bin", p)
    with open(p, "r+b") as f:
        f.truncate(500_000)
    with pytest.raises(ModelError, match="truncated"):
        load_llama2c(p)
