"""Synthetic llama2.c checkpoints: right shapes, reproducible, runnable."""
from __future__ import annotations

import os
import struct

import numpy as np
import pytest

import runtime
from frontends.arch import ModelConfig, expected_shapes
from frontends.llama2c import load_llama2c
from frontends.llama2c_tokenizer import Llama2cTokenizer
from frontends.llama2c_writer import llama2c_nbytes, write_llama2c
from frontends.synth import SHAPES, shape_config, synth_llama2c, synth_tensor, write_synth_tokenizer


def tiny(tied: bool = True, vocab: int = 300) -> ModelConfig:
    return ModelConfig(arch="llama", dim=32, hidden_dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                       vocab_size=vocab, seq_len=16, tied_output=tied)


def test_named_shapes():
    s = SHAPES["stories15M"]
    assert (s.dim, s.hidden_dim, s.n_layers, s.n_heads, s.n_kv_heads, s.vocab_size, s.seq_len) == \
        (288, 768, 6, 6, 6, 32000, 256)
    assert s.tied_output
    b = SHAPES["llama2-7b"]
    assert (b.dim, b.hidden_dim, b.n_layers, b.seq_len) == (4096, 11008, 32, 4096)
    assert not b.tied_output
    assert (SHAPES["stories42M"].hidden_dim, SHAPES["stories110M"].dim) == (1376, 768)
    # the real stories110M.bin is 438,381,596 bytes; llama2-7b fp32 is ~27 GB
    assert llama2c_nbytes(SHAPES["stories110M"], 0) == 438_381_596
    assert 26e9 < llama2c_nbytes(SHAPES["llama2-7b"], 0) < 28e9
    with pytest.raises(ValueError, match="unknown model shape"):
        shape_config("gpt5")


@pytest.mark.parametrize("version", [0, 1, 2])
@pytest.mark.parametrize("tied", [True, False])
def test_synth_loads_and_is_deterministic(tmp_path, version, tied):
    cfg = tiny(tied)
    a, b, c = tmp_path / "a.bin", tmp_path / "b.bin", tmp_path / "c.bin"
    synth_llama2c(cfg, a, seed=3, version=version, group_size=16)
    synth_llama2c(cfg, b, seed=3, version=version, group_size=16)
    synth_llama2c(cfg, c, seed=4, version=version, group_size=16)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    assert os.path.getsize(a) == llama2c_nbytes(cfg, version, 16)
    ck = load_llama2c(a)
    assert ck.version == version
    got = ck.config
    for k in ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len", "tied_output"):
        assert getattr(got, k) == getattr(cfg, k), k
    assert sorted(os.listdir(tmp_path)) == ["a.bin", "b.bin", "c.bin"]  # no temporary files left


def test_tensor_values(tmp_path):
    cfg = tiny()
    p = tmp_path / "m.bin"
    synth_llama2c(cfg, p, seed=1, version=1)
    ck = load_llama2c(p)
    raw = p.read_bytes()
    for name in ("token_embd", "blk.1.ffn_down", "blk.0.attn_norm"):
        ref = ck.weights[name].ref
        got = np.frombuffer(raw, np.float32, ref.nbytes // 4, ref.offset).reshape(expected_shapes(cfg)[name])
        np.testing.assert_array_equal(got, synth_tensor(cfg, name, seed=1))
    emb = synth_tensor(cfg, "token_embd", seed=1)
    assert abs(float(emb.std()) - 0.02) < 0.002
    assert np.all(synth_tensor(cfg, "output_norm") == 1.0)
    # tensors differ from each other, not just between seeds
    assert not np.array_equal(synth_tensor(cfg, "blk.0.attn_q"), synth_tensor(cfg, "blk.1.attn_q"))


def test_writer_takes_a_callable_and_cleans_up_on_error(tmp_path):
    cfg = tiny()
    p = tmp_path / "m.bin"
    asked = []

    def boom(name):
        asked.append(name)
        if name == "blk.1.attn_k":
            raise RuntimeError("disk on fire")
        return synth_tensor(cfg, name)

    p.write_bytes(b"old contents")
    with pytest.raises(RuntimeError, match="disk on fire"):
        write_llama2c(p, cfg, boom, version=0)
    assert p.read_bytes() == b"old contents"  # the old file untouched, no partial one left
    assert os.listdir(tmp_path) == ["m.bin"]
    assert asked[0] == "token_embd"


def test_tokenizer_writer(tmp_path):
    for vocab in (300, 40):
        t = tmp_path / f"tok{vocab}.bin"
        write_synth_tokenizer(t, vocab)
        tok = Llama2cTokenizer.from_file(t, vocab)
        assert tok.vocab_size == vocab
    # byte pieces where the real vocabularies have them
    data = (tmp_path / "tok300.bin").read_bytes()
    off = 4
    pieces = []
    while off < len(data):
        _, n = struct.unpack_from("<fi", data, off)
        pieces.append(data[off + 8: off + 8 + n])
        off += 8 + n
    assert pieces[3] == b"<0x00>" and pieces[258] == b"<0xFF>"
    assert len(set(pieces)) == len(pieces) == 300


@pytest.mark.parametrize("version", [0, 1, 2])
def test_interpreter_runs_a_synthetic_model(tmp_path, version):
    cfg = tiny(tied=version != 1)
    p, t = tmp_path / "m.bin", tmp_path / "tok.bin"
    synth_llama2c(cfg, p, version=version, group_size=16)
    write_synth_tokenizer(t, cfg.vocab_size)
    m = runtime.load(p, tokenizer=t, backend="interp")
    logits = m.logits([1, 5, 17, 299, 42])
    assert logits.shape == (5, cfg.vocab_size)
    assert np.all(np.isfinite(logits))
    assert float(np.abs(logits).max()) > 0
