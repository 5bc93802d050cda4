"""RoPE scaling as llama.cpp applies it, and no silent fallback for what lmc lacks.

Synthetic GGUFs (random F32 weights, the family's real tensor names and
keys) carry each scaling; llama.cpp (xllamacpp) generates 64 tokens greedily
and reports its top-20 log-probabilities at each, and lmc, teacher-forced
along the same tokens, must give the same argmax everywhere and centred
top-20 values within 1e-2, through the native prefill, the native decode
steps and the interpreter. Each case also checks it is a real test: the
same weights without the scaling disagree with llama.cpp.

Files carrying a key or tensor that changes the computation and that lmc
does not implement are refused by ``lmc run`` in one line, exit 2, before
anything is compiled.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import runtime
from frontends import arch as arch_table
from frontends.arch import ModelConfig, ModelError, RopeScaling, expected_shapes, optional_shapes
from frontends.gguf import load_gguf
from frontends.gguf_writer import write_gguf
from llamacpp_oracle import (assert_agrees_f32, compare, have_llamacpp, llamacpp_greedy, printable_vocab,
                             random_tensor, write_tensors_gguf)

PROMPT = [1, 45, 260, 7, 99, 150, 33, 210]
VOCAB = 300
HEAD = 32
#: Llama 3-style divisors, larger than Llama 3's (1..8) so that 64 positions feel them
LLAMA3_FACTORS = np.linspace(1.0, 40.0, HEAD // 2).astype(np.float32)


def config(arch: str, scaling: RopeScaling, **kw) -> ModelConfig:
    base = dict(arch=arch, dim=128, hidden_dim=256, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB,
                seq_len=512, rope_theta=10000.0, tied_output=False)
    base.update(kw)
    return ModelConfig(**base, rope_scaling=scaling)


GEMMA = dict(n_layers=6, n_kv_heads=1, tied_output=True, rope_theta=1e6,
             extra={"sliding_window": 24, "rope_local_theta": 10000.0})

CASES = {
    "llama rope_freqs": (config("llama", RopeScaling()), ["rope_freqs"]),
    "llama linear x4": (config("llama", RopeScaling("linear", 4.0)), []),
    "llama yarn x4": (config("llama", RopeScaling("yarn", 4.0, orig_ctx=64)), []),
    "qwen2 yarn x4 (neox)": (config("qwen2", RopeScaling("yarn", 4.0, orig_ctx=64)), []),
    "gemma3 linear x8 (global layers)": (config("gemma3", RopeScaling("linear", 8.0), **GEMMA), []),
}


def write(path: Path, cfg: ModelConfig, tensors: list[str], keep_scaling: bool = True) -> Path:
    shapes = {**expected_shapes(cfg), **optional_shapes(cfg)}
    weights = random_tensor(shapes, 0, {"rope_freqs": LLAMA3_FACTORS})
    if not keep_scaling:
        cfg, tensors = dataclasses.replace(cfg, rope_scaling=RopeScaling()), []
    write_gguf(path, cfg, weights, "F32", extra_tensors=tensors, vocab=printable_vocab(VOCAB))
    return path


@pytest.mark.parametrize("name", list(CASES))
def test_scaling_agrees_with_llama_cpp(name, tmp_path):
    have_llamacpp()
    cfg, tensors = CASES[name]
    path = write(tmp_path / "scaled.gguf", cfg, tensors)
    assert load_gguf(path).config.rope_scaling == cfg.rope_scaling
    ref = llamacpp_greedy(path, PROMPT, 64)
    assert len(ref.top) == 64
    assert_agrees_f32(path, PROMPT, ref, name)
    # the same weights without the scaling are a different model: the test can fail
    plain = runtime.load(write(tmp_path / "plain.gguf", cfg, tensors, keep_scaling=False), threads=2, ctx=128)
    off = compare(plain.logits, PROMPT, ref)
    print(off.row(f"{name}, scaling ignored"))
    assert off.worst_centred > 0.1


def test_gemma3_scales_only_its_global_layers(tmp_path, monkeypatch):
    """llama.cpp keeps Gemma 3's local layers unscaled (base 10000, factor
    1); scaling them too disagrees with it."""
    have_llamacpp()
    cfg, tensors = CASES["gemma3 linear x8 (global layers)"]
    path = write(tmp_path / "g.gguf", cfg, tensors)
    ref = llamacpp_greedy(path, PROMPT, 64)
    monkeypatch.setitem(arch_table.ARCHITECTURES, "gemma3",
                        dataclasses.replace(arch_table.ARCHITECTURES["gemma3"], scale_local_rope=True))
    wrong = compare(runtime.load(path, backend="interp", ctx=128).logits, PROMPT, ref)
    print(wrong.row("gemma3 with its local layers scaled too"))
    assert wrong.worst_centred > 0.1


def test_rope_attrs_per_layer():
    """The graph carries the scaling as rope attributes, per layer: Gemma 3's
    local layers (5 of 6) have none; Llama's frequency divisors are a weight
    of every layer."""
    from frontends.arch import WeightInfo, build_graph
    from ir.graph import WeightRef
    from ir.types import TensorType

    for cfg, tensors in (CASES["gemma3 linear x8 (global layers)"], CASES["llama rope_freqs"]):
        shapes = {**expected_shapes(cfg), **{t: optional_shapes(cfg)[t] for t in tensors}}
        weights = {n: WeightInfo(TensorType(s, "f32", "F32"), WeightRef("x", 0, 4 * int(np.prod(s))))
                   for n, s in shapes.items()}
        g = build_graph(cfg, weights, "decode", ctx=16)
        ropes = [n for n in g.nodes if n.op == "rope"]
        assert len(ropes) == 2 * cfg.n_layers
        if cfg.arch == "gemma3":
            scaled = [i // 2 for i, n in enumerate(ropes) if "freq_scale" in n.attrs]
            assert scaled == [5, 5] and ropes[10].attrs["freq_scale"] == 0.125
        else:
            assert [n.inputs[2].name for n in ropes[::2]] == ["blk.0.rope_freqs", "blk.1.rope_freqs"]
            assert all("freq_scale" not in n.attrs for n in ropes)


# --- refused files -----------------------------------------------------------------------------

def _lmc(*args: str, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "LMC_CACHE_DIR": str(cache)}
    return subprocess.run([sys.executable, "-m", "runtime.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env)


REFUSED = {
    "softcapping on llama": (dict(metadata={"llama.attn_logit_softcapping": 50.0}),
                             "llama.attn_logit_softcapping = 50.0: it sets attention-logit soft-capping"),
    "unknown scaling type": (dict(metadata={"llama.rope.scaling.type": "longrope",
                                            "llama.rope.scaling.factor": 4.0}),
                             "rope.scaling.type 'longrope' is not implemented"),
    "unknown key": (dict(metadata={"llama.attention.temperature_scale": 0.5}),
                    "llama.attention.temperature_scale = 0.5: lmc does not know this key"),
    "partial rotary": (dict(metadata={"llama.rope.dimension_count": 16}),
                       "rope.dimension_count = 16, not 32: partial rotary embeddings"),
    "custom yarn betas": (dict(metadata={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
                                         "llama.rope.scaling.yarn_beta_fast": 16.0}),
                          "yarn_beta_fast = 16.0: it sets custom YaRN correction dimensions"),
    "experts": (dict(metadata={"llama.expert_count": 8}), "expert_count = 8: mixture-of-experts"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_computation_changing_key_is_refused(name, tmp_path):
    kw, needle = REFUSED[name]
    cfg = config("llama", RopeScaling())
    path = tmp_path / "m.gguf"
    write_gguf(path, cfg, random_tensor(expected_shapes(cfg), 0), "F32", vocab=printable_vocab(VOCAB), **kw)
    with pytest.raises(ModelError, match="lmc"):
        load_gguf(path)
    cache = tmp_path / "cache"
    r = _lmc("run", str(path), "-p", "hi", "-n", "2", cache=cache)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"lmc: error: {path}: "), r.stderr
    assert needle in lines[0]
    assert not cache.exists() or not any(cache.rglob("*.so")), "native code was built for a refused file"


@pytest.mark.parametrize("arch,tensor,shape", [("llama", "blk.0.attn_q_norm", (HEAD,)),
                                                ("qwen2", "rope_freqs", (HEAD // 2,))])
def test_tensor_outside_the_family_is_refused(arch, tensor, shape, tmp_path):
    """A tensor the family does not use (llama.cpp would use it, or refuse
    the file) is an error naming it, not ignored."""
    from frontends.gguf_writer import family_metadata

    cfg = config(arch, RopeScaling())
    path = write_tensors_gguf(tmp_path / "m.gguf", arch, family_metadata(cfg), {**expected_shapes(cfg), tensor: shape},
                              VOCAB)
    with pytest.raises(ModelError, match=f"tensor {tensor} is not part of lmc's {arch} family"):
        load_gguf(path)


def test_convert_refuses_what_qsf_cannot_record(tmp_path):
    from frontends.convert import convert

    cfg, tensors = CASES["llama linear x4"]
    path = write(tmp_path / "scaled.gguf", cfg, tensors)
    with pytest.raises(ModelError, match="QSF version 1 cannot record"):
        convert(str(path), str(tmp_path / "out.qsf"), "q8")
    assert not (tmp_path / "out.qsf").exists()
