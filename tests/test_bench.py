"""``lmc bench`` and the bandwidth probe: every figure present and sane.

Timings never decide pass/fail beyond "positive and finite": machines differ.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import struct

import numpy as np
import pytest

from compiler.codegen.probe import measure_read_bandwidth, probe_sum
from compiler.codegen.target import host_target
from runtime.cli.bench import add_parser, format_table, run
from runtime.tools.bench import clip_lengths, run_bench

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = os.path.join(HERE, "..", "runtime", "default_model", "stories260K.bin")
TOKENIZER = os.path.join(HERE, "..", "runtime", "default_model", "tok512.bin")
PROBE = 64 << 20

FIELDS = ("compile_s_cold", "compile_s_warm", "prefill_tok_s", "decode_tok_s", "peak_rss_mb",
          "weight_bytes_per_token", "read_bandwidth_gb_s", "roofline_tok_s", "roofline_fraction")


def _native_works() -> bool:
    """The llvm backend is still being finished; without it the llvm bench is skipped."""
    from compiler.driver import load_model
    from compiler.native import NativeOptions, compile_native

    try:
        compile_native(load_model(MODEL, TOKENIZER), NativeOptions(use_cache=False))
    except NotImplementedError:
        return False
    return True


def header_weight_bytes(path: str) -> int:
    """Bytes one decode step reads, from the llama2.c v0 header alone: every
    matrix and norm; the embedding table whole, because it is also the
    classifier (tied)."""
    with open(path, "rb") as f:
        dim, hidden, layers, heads, kv_heads, vocab, _ = struct.unpack("<7i", f.read(28))
    assert vocab > 0  # tied
    kv_dim = dim // heads * kv_heads
    per_layer = (2 * dim                      # attention and ffn norms
                 + dim * dim * 2              # wq, wo
                 + kv_dim * dim * 2           # wk, wv
                 + hidden * dim * 3)          # w1, w2, w3
    return 4 * (vocab * dim + layers * per_layer + dim)


def check_report(r: dict, compiled: bool) -> None:
    for k in FIELDS:
        if not compiled and k.startswith("compile_s"):
            assert r[k] is None
            continue
        v = r[k]
        assert isinstance(v, (int, float)) and math.isfinite(v) and v > 0, (k, v)
    assert r["weight_bytes_per_token"] == header_weight_bytes(MODEL)
    assert r["model"] == "stories260K.bin"
    assert r["prompt_tokens"] == 12 and r["gen_tokens"] == 6 and r["threads"] == 2
    # which CPU the figures came from: /proc/cpuinfo's name, and LLVM's
    names = [ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.lower().startswith("model name")]
    assert r["cpu_model"] == names[0] and r["cpu"] == host_target().cpu
    json.dumps(r)
    assert "decode" in format_table(r) and names[0] in format_table(r)


def test_probe_sums_right():
    x = np.arange(4096, dtype=np.float32) % 7
    assert probe_sum(x) == pytest.approx(float(x.sum()))
    with pytest.raises(ValueError):
        probe_sum(np.ones(5, np.float32))


@pytest.mark.parametrize("threads", [1, 2])
def test_probe_bandwidth_positive(threads):
    bw = measure_read_bandwidth(threads, PROBE, repeats=2)
    assert math.isfinite(bw) and bw > 0.1


def test_clip_to_context():
    assert clip_lengths(256, 128, 128) == (128, 128)
    assert clip_lengths(200, 128, 128) == (72, 128)
    assert clip_lengths(100, 128, 128) == (1, 99)


def test_bench_interp_backend():
    r = run_bench(MODEL, TOKENIZER, threads=2, prompt_tokens=12, gen_tokens=6, runs=2, backend="interp",
                  probe_bytes=PROBE, probe_repeats=2)
    check_report(r, compiled=False)
    assert r["backend"] == "interp"


def test_bench_llvm_backend(tmp_path, monkeypatch):
    if not _native_works():
        pytest.skip("the native backend cannot compile stories260K yet")
    monkeypatch.setenv("LMC_CACHE_DIR", str(tmp_path / "user-cache"))
    r = run_bench(MODEL, TOKENIZER, threads=2, prompt_tokens=12, gen_tokens=6, runs=2,
                  probe_bytes=PROBE, probe_repeats=2)
    check_report(r, compiled=True)
    assert r["backend"] == "llvm"
    assert r["compile_s_warm"] < r["compile_s_cold"]
    assert os.environ["LMC_CACHE_DIR"] == str(tmp_path / "user-cache")
    assert not (tmp_path / "user-cache").exists()  # the user's cache untouched


def test_cli_json(capsys):
    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers(dest="cmd"))
    args = p.parse_args(["bench", MODEL, "-z", TOKENIZER, "-t", "2", "--prompt-tokens", "12",
                         "--gen-tokens", "6", "--runs", "1", "--backend", "interp", "--probe-mb", "64",
                         "--json"])
    assert run(args) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["weight_bytes_per_token"] == header_weight_bytes(MODEL)
    assert r["decode_tok_s"] > 0


def test_cold_start_times_lmc_run_from_an_empty_cache(capsys, tmp_path, monkeypatch):
    """``--cold-start``: each round's lmc run starts on a compile cache of
    its own, removed afterwards, then runs again warm with the same greedy
    text; the user's cache is not touched."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))   # where the rounds' caches go
    monkeypatch.setenv("LMC_CACHE_DIR", str(tmp_path / "user-cache"))
    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers(dest="cmd"))
    args = p.parse_args(["bench", MODEL, "-z", TOKENIZER, "-t", "2", "--prompt-tokens", "8",
                         "--gen-tokens", "4", "--runs", "2", "--probe-mb", "16", "--cold-start", "--json"])
    assert run(args) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["cold_start_text_identical"] is True
    assert len(r["cold_start_first_token_s_runs"]) == len(r["warm_start_first_token_s_runs"]) == 2
    for first, end in zip(r["cold_start_first_token_s_runs"], r["cold_start_exit_s_runs"]):
        assert 0 < first <= end
    assert r["cold_start_first_token_s"] > 0 and r["warm_start_first_token_s"] > 0
    assert r["cold_start_command"].startswith("lmc run stories260K.bin")
    assert not [f for f in os.listdir(tmp_path) if f.startswith("lmc-cold-start-")]   # removed after
    assert not (tmp_path / "user-cache").exists()
    assert "first token" in format_table(r)


def test_cold_start_is_not_a_serve_flag(capsys):
    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers(dest="cmd"))
    args = p.parse_args(["bench", MODEL, "-z", TOKENIZER, "--serve", "--cold-start"])
    from runtime.cli.common import CliError

    with pytest.raises(CliError, match="--cold-start"):
        run(args)



def test_long_prompt_is_measured_in_turns_with_the_prompt(capsys, tmp_path, monkeypatch):
    """``--long-prompt N``: generations after the prompt and after N random
    ids take turns; each pair gives the long prompt's rates over the short
    one's, and the report holds their medians and spreads."""
    monkeypatch.setenv("LMC_CACHE_DIR", str(tmp_path / "user-cache"))
    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers(dest="cmd"))
    args = p.parse_args(["bench", MODEL, "-z", TOKENIZER, "-t", "2", "--prompt-tokens", "12", "--gen-tokens", "6",
                         "--runs", "3", "--probe-mb", "64", "--long-prompt", "200", "--json"])
    assert run(args) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["prompt_tokens"] == 12 and r["long_prompt_tokens"] == 200
    for key in ("prefill", "decode"):
        assert r[f"long_{key}_tok_s"] > 0
        lo, hi = r[f"long_{key}_fraction_spread"]
        assert 0 < lo <= r[f"long_{key}_fraction"] <= hi, (key, lo, r[f"long_{key}_fraction"], hi)
    table = format_table(r)
    assert "long prompt" in table and "decode after it" in table


def test_long_prompt_past_the_context_is_one_line(tmp_path, monkeypatch):
    from runtime.errors import RunError

    monkeypatch.setenv("LMC_CACHE_DIR", str(tmp_path / "user-cache"))
    with pytest.raises(RunError, match=r"--long-prompt 5000: with 6 generated tokens it exceeds the context"):
        run_bench(MODEL, TOKENIZER, threads=2, prompt_tokens=12, gen_tokens=6, runs=1, probe_bytes=PROBE,
                  probe_repeats=1, long_prompt=5000)


def test_long_prompt_is_not_a_serve_flag():
    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers(dest="cmd"))
    args = p.parse_args(["bench", MODEL, "-z", TOKENIZER, "--serve", "--long-prompt", "100"])
    from runtime.cli.common import CliError

    with pytest.raises(CliError, match="--long-prompt"):
        run(args)


def test_long_prompt_beside_llamacpps(tmp_path):
    """``--long-prompt --compare-llamacpp`` on a real model: llama.cpp runs
    the long prompt too, and its fractions are its own figures' ratios."""
    pytest.importorskip("xllamacpp", reason="llama.cpp's server is the xllamacpp package (the test extra)")
    import subprocess
    import sys

    from shared_data import SMOLLM2, instruct_models

    env = {**os.environ, "PYTHONPATH": os.path.join(HERE, ".."), "LMC_CACHE_DIR": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "runtime.cli", "bench", instruct_models()[SMOLLM2], "--runs", "2",
                        "--prompt-tokens", "32", "--long-prompt", "300", "--gen-tokens", "8", "--probe-mb", "64",
                        "--compare-llamacpp", "--json"], env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["long_prompt_tokens"] == 300 and got["long_prefill_fraction"] > 0 and got["long_decode_fraction"] > 0
    ll = got["llamacpp"]
    assert "error" not in ll and "long_error" not in ll, ll
    assert ll["long_prefill_fraction"] == pytest.approx(ll["long_prefill_tok_s"] / ll["prefill_tok_s"])
    assert ll["long_decode_fraction"] == pytest.approx(ll["long_decode_tok_s"] / ll["decode_tok_s"])
