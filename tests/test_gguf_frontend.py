"""GGUF models: the frontend's checks, synthetic files of every writable
quant type, and stories260K.gguf against run.c."""
from __future__ import annotations

import struct

import numpy as np
import pytest

import runtime
from frontends.arch import ModelConfig, ModelError
from frontends.gguf import load_gguf
from frontends.gguf_writer import write_gguf
from frontends.synth import synth_tensor
from shared_data import MODELS, needs_shared, reference_cases

RUNC = reference_cases("stories260K_runc.json")


def float_native(path, **kw):
    """Native code on the float path (no ``int_dot``), compared with the
    interpreter's float references to 1e-4. The integer path quantizes x per
    block: an input that moves by an ulp can move a quantized value by a
    step, so there native and interpreter agree on tokens, not to 1e-4."""
    from compiler.pipeline import DEFAULT_PIPELINE

    return runtime.load(path, backend="llvm", threads=2, passes=DEFAULT_PIPELINE, **kw)


def tiny(tmp_path, qtype="Q8_0", name="tiny.gguf", **kw):
    base = dict(arch="llama", dim=256, hidden_dim=512, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=300,
                seq_len=64)
    base.update(kw)
    cfg = ModelConfig(**base)
    p = tmp_path / name
    write_gguf(p, cfg, lambda n: synth_tensor(cfg, n, 1), qtype)
    return p, cfg


@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_0", "Q4_K"])
def test_synthetic_gguf_runs_natively_like_the_interpreter(tmp_path, qtype):
    p, cfg = tiny(tmp_path, qtype)
    m = load_gguf(p)
    assert m.config.dim == 256 and m.config.n_kv_heads == 2 and m.config.tied_output
    assert m.weights["blk.0.attn_q"].type.layout == qtype
    ref = runtime.load(p, backend="interp")
    nat = runtime.load(p, backend="llvm", threads=2)
    ids = [1, 5, 77, 260, 9, 42]
    a, b = ref.logits(ids), float_native(p).logits(ids)
    assert np.abs(a - b).max() <= 1e-4 * max(1.0, float(np.abs(a).max()))
    assert list(ref.generate(ids, 8, temperature=0.0)) == list(nat.generate(ids, 8, temperature=0.0))


@needs_shared
@pytest.mark.parametrize("backend", ["interp", "llvm"])
def test_stories260K_gguf_reproduces_runc(backend):
    """The GGUF holds exactly the .bin's numbers, so the same tokens come out."""
    m = runtime.load(MODELS / "stories260K.gguf", backend=backend, kv_type="f32")   # run.c's cache
    for case in RUNC:
        n = case["steps"] - len(case["prompt_ids"]) + 1
        assert m.encode(case["prompt"]) == case["prompt_ids"]
        got = list(m.generate(case["prompt_ids"], n, temperature=case["temperature"], top_p=case["top_p"],
                              seed=case["seed"]))
        assert got == case["generated_ids"], case["prompt"]


def _err(path) -> str:
    with pytest.raises(ModelError) as e:
        load_gguf(path)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg
    return msg


def test_bad_gguf_files(tmp_path):
    p, cfg = tiny(tmp_path)
    data = p.read_bytes()
    m = load_gguf(p)
    # truncated anywhere: refused before anything reads tensor data
    for cut in (10, 200, len(data) // 2, len(data) - 1):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        _err(tmp_path / "cut.gguf")
    # tensor data outside the file: grow a tensor's offset in its info record
    last = max(m.weights.values(), key=lambda w: w.ref.offset)
    name = [k for k, w in m.weights.items() if w is last][0]
    key = (name + ".weight").encode()
    at = data.index(key) + len(key)
    n_dims = struct.unpack_from("<I", data, at)[0]
    off_at = at + 4 + 8 * n_dims + 4
    bad = bytearray(data)
    struct.pack_into("<Q", bad, off_at, struct.unpack_from("<Q", data, off_at)[0] + (1 << 20))
    (tmp_path / "far.gguf").write_bytes(bytes(bad))
    assert "outside the file" in _err(tmp_path / "far.gguf") or "not a readable GGUF" in _err(tmp_path / "far.gguf")
    # a shape that does not fit the config: the metadata claims 4 KV heads,
    # the K projection holds 2
    key = b"llama.attention.head_count_kv"
    at = data.index(key) + len(key)
    assert struct.unpack_from("<II", data, at) == (4, 2)  # (type UINT32, value)
    bad = bytearray(data)
    struct.pack_into("<I", bad, at + 4, 4)
    (tmp_path / "kv.gguf").write_bytes(bytes(bad))
    assert "blk.0.attn_k has shape (128, 256), the config needs (256, 256)" in _err(tmp_path / "kv.gguf")
    # a context length of 0 (or absurd): refused at load, naming the key, instead of blaming -c
    # or the prompt later
    key = b"llama.context_length"
    at = data.index(key) + len(key)
    assert struct.unpack_from("<I", data, at)[0] == 4   # UINT32
    for n in (0, 1 << 30):
        bad = bytearray(data)
        struct.pack_into("<I", bad, at + 4, n)
        (tmp_path / "ctx.gguf").write_bytes(bytes(bad))
        assert f"llama.context_length = {n} is out of range" in _err(tmp_path / "ctx.gguf")
    # unknown architecture: the message lists the supported ones
    raw = p.read_bytes().replace(b"general.architecture\x08\x00\x00\x00\x05\x00\x00\x00\x00\x00\x00\x00llama",
                                 b"general.architecture\x08\x00\x00\x00\x05\x00\x00\x00\x00\x00\x00\x00llamb")
    (tmp_path / "arch.gguf").write_bytes(raw)
    msg = _err(tmp_path / "arch.gguf")
    assert "llamb" in msg and "gemma3" in msg and "qwen2" in msg


def test_missing_tensor_and_unsupported_type(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "miss.gguf"), "llama")
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(2)
    w.add_context_length(32)
    w.add_tensor("token_embd.weight", np.zeros((300, 64), np.float32))
    w.add_tensor("output_norm.weight", np.ones(64, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert "missing tensor blk.0.attn_norm" in _err(tmp_path / "miss.gguf")
    w = gguf.GGUFWriter(str(tmp_path / "iq.gguf"), "llama")
    w.add_embedding_length(64)
    w.add_tensor("token_embd.weight", np.zeros((300, 256 // 256 * 66), np.uint8), raw_dtype=gguf.GGMLQuantizationType.IQ2_XXS)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert "IQ2_XXS" in _err(tmp_path / "iq.gguf")


def test_qwen2_row_uses_its_biases(tmp_path):
    """qwen2 = llama + Q/K/V biases + NeoX RoPE: a synthetic qwen2 GGUF runs
    the same on both backends, and its biases change the result."""
    p, cfg = tiny(tmp_path, "Q8_0", name="qwen.gguf", arch="qwen2")
    m = load_gguf(p)
    assert m.config.arch == "qwen2" and "blk.1.attn_k.bias" in m.weights
    ref = runtime.load(p, backend="interp")
    ids = [1, 50, 7, 299, 3]
    a, b = ref.logits(ids), float_native(p).logits(ids)
    assert np.abs(a - b).max() <= 1e-4 * max(1.0, float(np.abs(a).max()))
    from compiler.driver import model_graph

    g = model_graph(ref.loaded, "decode")
    assert sum(n.op == "bias_add" for n in g.nodes) == 3 * cfg.n_layers
    assert all(n.attrs["style"] == "neox" for n in g.nodes if n.op == "rope")
    # the same weights read as llama (no biases, interleaved RoPE) give other numbers
    p2, _ = tiny(tmp_path, "Q8_0", name="llama.gguf")
    c = runtime.load(p2, backend="interp").logits(ids)
    assert np.abs(a - c).max() > 1e-3
