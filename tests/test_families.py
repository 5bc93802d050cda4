"""Every row of the architecture table, proven against llama.cpp.

For each family a small synthetic GGUF (random weights with the family's
real structure: its tensor names, fused tensors where llama.cpp's converter
fuses them, its metadata keys, GQA) is written with ``gguf``'s writer; llama.cpp
(``xllamacpp``) generates 64 tokens greedily and reports its top-20
log-probabilities at each position; lmc, teacher-forced along the same
tokens, is compared row by row (centred, ``llamacpp_oracle.compare``):

* F32 weights: the argmax equal at all 64 positions and the largest centred
  top-20 difference <= 1e-2, through the native prefill, the native decode
  steps and the IR interpreter;
* Q8_0, Q2_K, Q3_K and Q4_K weights (and, in the llama family, TQ1_0,
  TQ2_0, IQ4_NL, IQ4_XS and MXFP4): the argmax equal at every decisive
  position (where llama.cpp's top-1 leads by >= 0.5), native prefill and
  decode (the default pipeline: the integer path where the host has VNNI).

Each family also has a control: the same file read as a neighbouring family
(what lmc computed before the row existed) disagrees, so the comparison can
fail.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

import runtime
from frontends.arch import ARCHITECTURES, ModelConfig, file_shapes, optional_shapes
from frontends.gguf import load_gguf
from frontends.gguf_writer import write_gguf
from llamacpp_oracle import (assert_agrees_f32, compare, decode_logits, have_llamacpp, llamacpp_greedy,
                             printable_vocab, random_tensor, write_tensors_gguf)

PROMPT = [1, 45, 260, 7, 99, 150, 33, 210]
VOCAB = 300
N = 64


def config(arch: str, **kw) -> ModelConfig:
    base = dict(arch=arch, dim=256, hidden_dim=512, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB,
                seq_len=256, rope_theta=10000.0, tied_output=False, norm_eps=1e-5)
    base.update(kw)
    return ModelConfig(**base)


#: one synthetic model per row; optional tensors each family's real files carry
FAMILIES: dict[str, tuple[ModelConfig, list[str]]] = {
    "llama": (config("llama"), []),
    "mistral": (config("mistral"), []),
    "qwen2": (config("qwen2", rope_theta=1e6), []),
    "qwen3": (config("qwen3", rope_theta=1e6, head_dim=32), []),
    "phi3": (config("phi3", n_kv_heads=4), []),
    "gpt2": (config("gpt2", n_kv_heads=4, tied_output=True), []),
    "starcoder2": (config("starcoder2", rope_theta=1e5), []),
    "phi2": (config("phi2", n_kv_heads=4, rope_dims=32), ["output.bias"]),
    "gemma2": (config("gemma2", n_layers=4, n_kv_heads=1, tied_output=True,
                      extra={"sliding_window": 24, "attn_softcap": 50.0, "final_softcap": 30.0}), []),
    "gemma3": (config("gemma3", n_layers=6, n_kv_heads=1, tied_output=True, rope_theta=1e6,
                      extra={"sliding_window": 24, "rope_local_theta": 10000.0}), []),
}

#: per row, the change to it that a control reads the file with (the row's own
#: feature switched off): llama.cpp must then disagree
CONTROL = {"llama": dict(rope_style="neox"), "mistral": dict(rope_style="neox"),
           "qwen2": dict(rope_style="interleaved"), "qwen3": dict(qk_norm=False),
           "phi3": dict(rope_style="interleaved"), "gpt2": dict(norm="rms"), "starcoder2": dict(ffn_act="silu"),
           "phi2": dict(rope_style="interleaved"), "gemma2": dict(softcap=False), "gemma3": dict(qk_norm=False)}


def test_every_row_is_tested():
    assert set(FAMILIES) == set(ARCHITECTURES)


#: llama.cpp has no "mistral" architecture (Mistral's files say "llama"): it
#: runs the same weights written as llama, which lmc's mistral row must match
ORACLE_ARCH = {"mistral": "llama"}


def write_family(path: Path, family: str, qtype: str, arch: str | None = None) -> Path:
    cfg, extra = FAMILIES[family]
    if arch:
        cfg = dataclasses.replace(cfg, arch=arch)
    shapes = {**file_shapes(cfg), **{t: optional_shapes(cfg)[t] for t in extra}}
    write_gguf(path, cfg, random_tensor(shapes, 7), qtype, extra_tensors=extra, vocab=printable_vocab(VOCAB))
    return path


_REFS: dict[tuple[str, str], tuple[Path, object]] = {}


def reference(family: str, qtype: str, tmp_path_factory) -> tuple[Path, object]:
    """The family's file and llama.cpp's greedy run on it (once per session)."""
    key = (family, qtype)
    if key not in _REFS:
        have_llamacpp()
        d = tmp_path_factory.mktemp(f"{family}-{qtype}")
        path = write_family(d / "m.gguf", family, qtype)
        oracle = write_family(d / "oracle.gguf", family, qtype, ORACLE_ARCH[family]) if family in ORACLE_ARCH else path
        _REFS[key] = path, llamacpp_greedy(oracle, PROMPT, N)
    return _REFS[key]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_f32_agrees_with_llama_cpp(family, tmp_path_factory):
    path, ref = reference(family, "F32", tmp_path_factory)
    assert len(ref.top) == N
    cfg = load_gguf(path).config
    want, _ = FAMILIES[family]
    assert (cfg.arch, cfg.n_kv_heads, cfg.rope_dims, cfg.extra) == (want.arch, want.n_kv_heads, want.rope_dims,
                                                                   want.extra)
    assert_agrees_f32(path, PROMPT, ref, f"{family} F32", N)


#: (family, quant type): the four types in every family; the ternary types
#: (BitNet b1.58 files: Gaussian weights rounded to -d, 0, +d are a different
#: model, but the one both read) and the table types (IQ4_NL, IQ4_XS, MXFP4)
#: in llama's
QUANTIZED = [(f, q) for f in FAMILIES for q in ("Q8_0", "Q2_K", "Q3_K", "Q4_K")] + \
    [("llama", q) for q in ("TQ1_0", "TQ2_0", "IQ4_NL", "IQ4_XS", "MXFP4")]


@pytest.mark.parametrize("family,qtype", QUANTIZED)
def test_quantized_agrees_at_decisive_positions(family, qtype, tmp_path_factory):
    path, ref = reference(family, qtype, tmp_path_factory)
    native = runtime.load(path, threads=2, ctx=128)
    seq = PROMPT + ref.generated
    for how, logits in (("prefill", native.logits(seq)), ("decode", decode_logits(native, seq, len(PROMPT)))):
        decisive, missed = decisive_misses(logits, ref)
        a = compare(lambda s: logits, PROMPT, ref)
        print(f"{a.row(f'{family} {qtype} {how}')}; decisive positions {decisive - missed}/{decisive} equal")
        assert decisive >= N // 4, f"only {decisive} decisive positions: the model compares too little"
        assert missed == 0, f"{family} {qtype} {how}: {missed} of {decisive} decisive positions differ"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_control_disagrees(family, tmp_path_factory, monkeypatch):
    """The file read with the row's own feature switched off (``CONTROL``;
    the tensors and keys it leaves unused are let through) disagrees with
    llama.cpp: the comparison can fail."""
    import frontends.gguf as gguf_frontend

    path, ref = reference(family, "F32", tmp_path_factory)
    monkeypatch.setitem(ARCHITECTURES, family, dataclasses.replace(ARCHITECTURES[family], **CONTROL[family]))
    monkeypatch.setattr(gguf_frontend, "check_weights", lambda *a: None)
    monkeypatch.setattr(gguf_frontend, "check_metadata", lambda *a: None)
    a = compare(runtime.load(path, backend="interp", ctx=128).logits, PROMPT, ref)
    print(a.row(f"{family} with {CONTROL[family]}"))
    assert a.worst_centred > 0.1


def decisive_misses(logits: np.ndarray, ref) -> tuple[int, int]:
    """(decisive positions, how many of them lmc's argmax misses)."""
    decisive = missed = 0
    for k, top in enumerate(ref.top):
        if top[0][1] - top[1][1] >= 0.5:
            decisive += 1
            missed += int(np.argmax(logits[len(PROMPT) - 1 + k])) != top[0][0]
    return decisive, missed


@pytest.mark.parametrize("family", list(FAMILIES))
def test_qsf_keeps_the_family(family, tmp_path_factory, tmp_path):
    """``lmc convert`` to QSF (8-bit) keeps the row and its values (rotary
    dims, soft-caps, window): the converted model agrees with llama.cpp on
    the F32 original at every decisive position."""
    import subprocess
    import sys

    path, ref = reference(family, "F32", tmp_path_factory)
    out = tmp_path / "m.qsf"
    r = subprocess.run([sys.executable, "-m", "runtime.cli", "convert", str(path), str(out), "--qtype", "q8"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    model = runtime.load(out, threads=2, ctx=128)
    src = load_gguf(path).config
    got = model.config
    assert (got.arch, got.rope_dims, got.extra, got.tied_output) == (src.arch, src.rope_dims, src.extra,
                                                                     src.tied_output)
    decisive, missed = decisive_misses(model.logits(PROMPT + ref.generated), ref)
    print(f"{family} QSF q8: decisive positions {decisive - missed}/{decisive} equal")
    assert decisive >= N // 4 and missed == 0


def _write_raw(path: Path, arch: str, cfg: ModelConfig, shapes: dict[str, tuple[int, ...]],
               metadata: dict | None = None) -> Path:
    """A GGUF with exactly ``shapes``' tensors and ``cfg``'s keys under ``arch``."""
    from frontends.gguf_writer import family_metadata

    keys = family_metadata(dataclasses.replace(cfg, arch=arch) if arch in ARCHITECTURES else cfg)
    keys = {k.replace(f"{cfg.arch}.", f"{arch}."): v for k, v in {**keys, **(metadata or {})}.items()}
    return write_tensors_gguf(path, arch, keys, shapes, VOCAB)


def _bad_files(tmp: Path) -> dict[str, tuple[Path, str]]:
    gpt2, _ = FAMILIES["gpt2"]
    phi3, _ = FAMILIES["phi3"]
    missing = {k: v for k, v in file_shapes(gpt2).items() if k != "blk.1.ffn_up.bias"}
    return {
        "unknown architecture": (_write_raw(tmp / "falcon.gguf", "falcon", FAMILIES["llama"][0],
                                            file_shapes(FAMILIES["llama"][0])), "unsupported architecture 'falcon'"),
        "missing tensor": (_write_raw(tmp / "gpt2.gguf", "gpt2", gpt2, missing), "missing tensor blk.1.ffn_up.bias"),
        "metadata against shapes": (_write_raw(tmp / "phi3.gguf", "phi3", phi3, file_shapes(phi3),
                                               {"phi3.feed_forward_length": 384}),
                                    "tensor blk.0.ffn_up has shape (1024, 256), the config needs (768, 256)"),
    }


def test_bad_family_files_get_one_line(tmp_path):
    """``lmc run`` on an unknown architecture, a file missing one of its
    family's tensors, and metadata that contradicts the tensor shapes: one
    line naming the file and the problem, exit 2, nothing compiled."""
    import os
    import subprocess
    import sys

    for what, (path, needle) in _bad_files(tmp_path).items():
        cache = tmp_path / f"cache-{path.stem}"
        r = subprocess.run([sys.executable, "-m", "runtime.cli", "run", str(path), "-p", "hi", "-n", "2"],
                           capture_output=True, text=True, timeout=300, env={**os.environ, "LMC_CACHE_DIR": str(cache)})
        lines = r.stderr.strip().splitlines()
        print(f"{what}: {r.stderr.strip()}")
        assert r.returncode == 2 and len(lines) == 1, (what, r.stderr)
        assert lines[0].startswith(f"lmc: error: {path}: ") and needle in lines[0], (what, lines[0])
        assert not cache.exists() or not any(cache.rglob("*.so")), what
