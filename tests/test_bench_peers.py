"""``lmc bench --compare-openvino``: OpenVINO GenAI measured on the same
GGUF in the same run (the ``peers`` extra). Its figures are positive, the
ratios are ours over its, and a file its reader refuses (Qwen2.5-Coder's
Q5_0 tensors) gives one clear line in the report, not a failure of the
bench. Speed itself is never asserted."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shared_data import QWEN, SMOLLM2, instruct_models

pytest.importorskip("openvino_genai", reason="OpenVINO GenAI is the `peers` extra: pip install -e '.[peers]'")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench(path: str, tmp_path) -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT, "LMC_CACHE_DIR": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "runtime.cli", "bench", path, "--runs", "1", "--prompt-tokens", "32",
                        "--gen-tokens", "4", "--probe-mb", "64", "--compare-openvino", "--json"],
                       env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_openvino_beside_ours_on_smollm2(tmp_path):
    r = _bench(instruct_models()[SMOLLM2], tmp_path)
    ov = r["openvino"]
    assert "error" not in ov, ov
    assert ov["prefill_tok_s"] > 0 and ov["decode_tok_s"] > 0
    # the report rounds its top-level figures to 6 decimals (a ratio near 0.08 keeps 5 digits)
    assert r["prefill_vs_openvino"] == pytest.approx(r["prefill_tok_s"] / ov["prefill_tok_s"], rel=1e-4)
    assert r["decode_vs_openvino"] == pytest.approx(r["decode_tok_s"] / ov["decode_tok_s"], rel=1e-4)


def test_a_file_openvino_refuses_is_one_line(tmp_path):
    r = _bench(instruct_models()[QWEN], tmp_path)
    err = r["openvino"].get("error")
    assert isinstance(err, str) and err and "\n" not in err
    assert "prefill_vs_openvino" not in r and r["prefill_tok_s"] > 0
