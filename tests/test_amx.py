"""AMX tiles through the interfaces a user has: ``runtime.load`` in a process
that may use them and in one with ``LMC_AMX=0`` give the same bits (every
prompt row's logits, the greedy tokens), and ``lmc bench --json`` says which
int8 unit ran and why. The kernels themselves are compared bit for bit in
``test_bits_on_every_cpu`` (every type, forced on)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from compiler.codegen.target import amx_status, host_target
from shared_data import SMOLLM2, instruct_models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_RUN = r"""
import sys, numpy as np, runtime
path, out = sys.argv[1], sys.argv[2]
m = runtime.load(path, ctx=256, threads=2, kv_type="f32")
ids = m.encode("Write a short story about a robot who learns to paint, in three sentences. " * 2, bos=True)
ex = m.executor
ex.reset()
logits = ex.prefill(ids, 0, all_logits=True)
toks = list(m.generate(ids, 16, temperature=0.0, stop=False))
from compiler.codegen.target import amx_status
np.savez(out, logits=logits, toks=np.array(toks), n=len(ids), amx=amx_status()["used"])
"""


def _run(path: str, out: str, amx: str, cache: str) -> dict:
    env = {**os.environ, "LMC_AMX": amx, "LMC_CACHE_DIR": cache, "PYTHONPATH": ROOT}
    r = subprocess.run([sys.executable, "-c", _RUN, path, out], env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    return dict(np.load(out))


def test_amx_and_lmc_amx_0_give_the_same_bits(tmp_path):
    """SmolLM2's Q4_1 matrices take the tiles from 16 prompt rows on (its
    traits row): a prompt of ~40 tokens through both processes, every row's
    logits the same bits, and the same 16 greedy tokens. With an f32 cache,
    whose attention is the per-row kernel's on every host (the AMX bf16
    prompt attention, ``k_attention_tiled``, when turned on, takes f16
    caches only: f32's arithmetic to ~1e-6, but not its bits)."""
    if not host_target().amx:
        pytest.skip(f"AMX: {amx_status()['why']}")
    path = instruct_models()[SMOLLM2]
    on = _run(path, str(tmp_path / "on.npz"), "1", str(tmp_path / "cache"))
    off = _run(path, str(tmp_path / "off.npz"), "0", str(tmp_path / "cache"))
    assert bool(on["amx"]) and not bool(off["amx"])
    assert int(on["n"]) >= 32
    np.testing.assert_array_equal(on["logits"].view(np.uint32), off["logits"].view(np.uint32))
    np.testing.assert_array_equal(on["toks"], off["toks"])


def test_bench_json_says_which_int8_unit_ran(tmp_path):
    """``lmc bench --json`` names the int8 unit and AMX's status with its
    reason, and with ``LMC_AMX=0`` says VNNI and why; the probes alternate
    with the runs and their spread is reported (the bundled stories260K:
    llama2.c float32, so no prefill int8 figures, but the unit and the
    bandwidth roofline)."""
    from runtime.models import BUNDLED_MODEL, BUNDLED_TOKENIZER

    def bench(amx: str) -> dict:
        env = {**os.environ, "LMC_AMX": amx, "PYTHONPATH": ROOT, "LMC_CACHE_DIR": str(tmp_path)}
        r = subprocess.run([sys.executable, "-m", "runtime.cli", "bench", BUNDLED_MODEL, "-z", BUNDLED_TOKENIZER,
                            "--runs", "1", "--prompt-tokens", "32", "--gen-tokens", "4", "--probe-mb", "64",
                            "--json"], env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    off = bench("0")
    assert off["amx"] == {"used": False, "why": "LMC_AMX=0"} or not host_target().has("amx-int8")
    assert off["int8_unit"] in ("vnni", None)
    for key in ("read_bandwidth_spread_gb_s", "roofline_fraction_spread"):
        lo, hi = off[key]
        assert 0 < lo <= hi
    if host_target().amx:
        on = bench("1")
        assert on["amx"]["used"] and on["int8_unit"] == "amx"
        assert "prefill_int8_fraction" not in on   # a float32 model: no int8 matmuls to judge
