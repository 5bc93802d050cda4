"""Cold and warm starts as a user meets them (``lmc bench --cold-start``).

``lmc run`` runs in a child process with an empty compile cache of its own
(kernel cache included, so nothing an earlier round compiled helps), timed
to its first token and to its exit, then the same command again on the
cache it filled. ``lmc run`` prints the prompt together with the first
token, so the first byte on its stdout is the first token. Both runs
generate greedily, so their text must be the same.
"""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from ..errors import RunError
from .bench_servers import ROOT

#: what each start runs: a short prompt and a few tokens (a first run's needs)
PROMPT = "Hello"
TOKENS = 4


def _timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """(seconds to the first byte on stdout, seconds to exit, the output)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT, bufsize=0)
    first = p.stdout.read(1)
    t1 = time.perf_counter()
    rest, err = p.communicate()   # both pipes at once: a full stderr pipe cannot block the child
    t2 = time.perf_counter()
    if p.returncode != 0:
        last = (err.decode(errors="replace").strip().splitlines() or ["no message"])[-1]
        raise RunError(f"--cold-start: lmc run exited with {p.returncode}: {last}")
    return t1 - t0, t2 - t0, (first + rest).decode(errors="replace")


def measure(model_path: str, tokenizer: str | None, threads: int, runs: int) -> dict[str, Any]:
    """``runs`` rounds of a cold then a warm ``lmc run``; medians and every run."""
    cmd = [sys.executable, "-m", "runtime.cli", "run", os.path.abspath(model_path), "-p", PROMPT,
           "-n", str(TOKENS), "--temp", "0", "-t", str(threads)]
    if tokenizer is not None:
        cmd += ["-z", os.path.abspath(tokenizer)]
    cold, cold_exit, warm, texts = [], [], [], set()
    for _ in range(runs):
        cache = tempfile.mkdtemp(prefix="lmc-cold-start-")
        env = {**os.environ, "LMC_CACHE_DIR": cache}
        try:
            first, end, text = _timed(cmd, env)
            cold.append(first)
            cold_exit.append(end)
            texts.add(text)
            first, _, text = _timed(cmd, env)
            warm.append(first)
            texts.add(text)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    return {
        "cold_start_command": f"lmc run {os.path.basename(model_path)} -p {PROMPT} -n {TOKENS} --temp 0 -t {threads}",
        "cold_start_first_token_s": statistics.median(cold),
        "cold_start_first_token_s_runs": [round(x, 3) for x in cold],
        "cold_start_exit_s_runs": [round(x, 3) for x in cold_exit],
        "warm_start_first_token_s": statistics.median(warm),
        "warm_start_first_token_s_runs": [round(x, 3) for x in warm],
        "cold_start_text_identical": len(texts) == 1,
    }
