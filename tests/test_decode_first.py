"""A cold start that runs on its decode step first (``decode_first``, what
``lmc run`` and ``lmc chat`` do): the prompt runs as decode steps while the
prompt chunks' kernels compile in the background, then the whole artifact
takes over. The numbers must not depend on when that happens: a prompt row
computed as a decode step has a prompt chunk's bits."""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import threading
import time
from typing import Callable

import numpy as np
import pytest

import runtime
from compiler import native
from shared_data import ROOT, SMOLLM2, instruct_models

#: the background build's worker processes (one per core the process may use) are the subject:
#: every core, not an xdist worker's share (``conftest.whole_machine``)
pytestmark = pytest.mark.usefixtures("whole_machine")

PROMPT = ("def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n"
          "    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n")


@pytest.fixture
def held_build(monkeypatch) -> threading.Event:
    """The rest of a decode-first build waits until this event is set."""
    gate = threading.Event()
    build = native.RestOfBuild._build

    def held(self):
        gate.wait(timeout=600)
        return build(self)

    monkeypatch.setattr(native.RestOfBuild, "_build", held)
    return gate


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """A compile cache of this test's own, empty: a cold start."""
    path = tmp_path / "cache"
    monkeypatch.setenv("LMC_CACHE_DIR", str(path))
    return path


def steps_then(ex, at: int, then: Callable[[], None]) -> list[int]:
    """The positions of ``ex``'s decode steps from now on, in a list that fills as
    they run; ``then()`` is called after the step at position ``at``."""
    steps: list[int] = []
    decode = ex.decode

    def step(token: int, pos: int) -> np.ndarray:
        steps.append(pos)
        out = decode(token, pos)
        if pos == at:
            then()
        return out

    ex.decode = step
    return steps


def test_prompt_as_decode_steps_then_as_chunks_has_the_same_logits(empty_cache, held_build):
    """Held back until released, the rest of the build cannot finish: the
    model starts on an artifact with a decode step only and a 200-token
    prompt (more than a 128-row chunk) runs as 200 decode steps. Once the
    whole artifact is built it runs as chunks. Each row's logits are those
    of a model loaded warm, bit for bit, and so are the greedy tokens."""
    model = instruct_models()[SMOLLM2]
    m = runtime.load(model, threads=2, decode_first=True)
    assert m.compile_info["decode_first"] and not m.compile_info["cache_hit"]
    assert set(m.executor.entries) == {"decode"} and m.compiling
    ids = m.encode(PROMPT * 4)[:200]
    assert len(ids) == 200
    by_steps = m.logits(ids)
    greedy_by_steps = list(m.generate(ids[:150], 12))
    assert set(m.executor.entries) == {"decode"}   # still on the decode step alone

    # the rest compiles at the lowest priority while the model runs; waiting for it gives
    # the workers their priority back where the system allows a process to raise it
    kernels = m.executor._rest._kernels
    workers = [p.pid for p in kernels._processes()]
    assert workers and {os.getpriority(os.PRIO_PROCESS, w) for w in workers} == {19}
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    may_raise = os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20 - ours
    waiter = threading.Thread(target=m.finish_compiling)
    waiter.start()
    want = {ours if may_raise else 19}
    try:
        for _ in range(500):
            if {os.getpriority(os.PRIO_PROCESS, w) for w in workers} == want:
                break
            time.sleep(0.01)
        assert {os.getpriority(os.PRIO_PROCESS, w) for w in workers} == want
    finally:
        held_build.set()
        waiter.join(timeout=600)
    assert not waiter.is_alive()
    by_chunks = m.logits(ids)     # the whole artifact is taken at this call's first step
    assert {"decode", "prefill", "prefill_all"} <= set(m.executor.entries) and not m.compiling
    greedy_by_chunks = list(m.generate(ids[:150], 12))

    warm = runtime.load(model, threads=2)
    assert warm.compile_info["cache_hit"]          # the rest of the build was cached
    reference = warm.logits(ids)
    np.testing.assert_array_equal(by_steps, reference)
    np.testing.assert_array_equal(by_chunks, reference)
    assert greedy_by_steps == greedy_by_chunks == list(warm.generate(ids[:150], 12))


def test_a_prompt_switches_to_chunks_when_the_rest_arrives_between_its_steps(empty_cache, held_build):
    """The whole artifact arrives while a prompt runs as decode steps: the
    rest of that prompt runs as chunks, and the rows keep their bits."""
    model = instruct_models()[SMOLLM2]
    m = runtime.load(model, threads=2, decode_first=True)
    ex = m.executor

    def finish() -> None:   # the build may finish now; the next row finds it offered
        held_build.set()
        m.finish_compiling()

    steps = steps_then(ex, 39, finish)
    ids = m.encode(PROMPT * 4)[:180]
    mixed = m.logits(ids)
    assert steps == list(range(40))      # 40 rows as decode steps, then 140 as chunks
    assert "prefill_all" in ex.entries
    warm = runtime.load(model, threads=2)
    np.testing.assert_array_equal(mixed, warm.logits(ids))


def test_lmc_run_cold_then_warm(empty_cache):
    """``lmc run`` on an empty cache starts on the decode step, finishes
    the compile before it exits (so the next run is a cache hit) and
    prints the same greedy tokens as that next run."""
    model = instruct_models()[SMOLLM2]
    env = {**os.environ, "LMC_CACHE_DIR": str(empty_cache)}

    def run() -> dict:
        r = subprocess.run([sys.executable, "-m", "runtime.cli", "run", model, "-p", PROMPT, "-n", "16",
                            "--temp", "0", "--json", "-t", "2"], capture_output=True, text=True, cwd=ROOT,
                           env=env, timeout=600)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    cold, warm = run(), run()
    assert cold["stats"]["decode_first"] and not cold["stats"]["cache_hit"]
    assert warm["stats"]["cache_hit"] and "decode_first" not in warm["stats"]
    assert cold["generated_ids"] == warm["generated_ids"] and len(cold["generated_ids"]) == 16


def test_a_long_prompt_waits_for_its_chunks_where_the_tiles_begin(empty_cache, held_build, monkeypatch):
    """From ``compiler.driver.FROM_POSITION`` on a prompt chunk's rows attend
    on AMX bf16 tiles (where the host has them), which a decode step does
    not: a prompt run as decode steps stops there and waits for the whole
    artifact, so its rows still have a warm model's bits."""
    from compiler.driver import FROM_POSITION

    monkeypatch.delenv("LMC_ATTN_TILED", raising=False)
    model = instruct_models()[SMOLLM2]
    ctx = 2 * FROM_POSITION
    m = runtime.load(model, threads=2, ctx=ctx, decode_first=True)
    ex = m.executor
    steps = steps_then(ex, FROM_POSITION - 1, held_build.set)   # the build may finish now; the prompt waits
    ids = (m.encode(PROMPT) * 30)[: FROM_POSITION + 60]
    assert len(ids) == FROM_POSITION + 60
    got = m.logits(ids)
    assert steps == list(range(FROM_POSITION))
    assert "prefill_all" in ex.entries
    warm = runtime.load(model, threads=2, ctx=ctx)
    np.testing.assert_array_equal(got, warm.logits(ids))
