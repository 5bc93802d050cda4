"""The native backend end to end: artifacts, the cache, threads, and
agreement with the interpreter and run.c."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import runtime
from compiler.artifact import Artifact, ArtifactError
from compiler.driver import load_model
from compiler.native import NativeOptions, compile_native
from passes.plan_arena import check_plan, plan_arena
from runtime.cli import DEFAULT_MODEL, DEFAULT_TOKENIZER
from shared_data import MODELS, ROOT, needs_shared, reference_cases

RUNC = reference_cases("stories260K_runc.json")


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """An empty compile cache for tests about the cache itself."""
    monkeypatch.setenv("LMC_CACHE_DIR", str(tmp_path / "cache"))


def lmc(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runtime.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=600, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_llvm_logits_match_interpreter(threads):
    # f32 caches: the kernels' numbers, not f16's rounding of their last bits
    ref = runtime.load(DEFAULT_MODEL, DEFAULT_TOKENIZER, backend="interp", kv_type="f32")
    nat = runtime.load(DEFAULT_MODEL, DEFAULT_TOKENIZER, backend="llvm", threads=threads, kv_type="f32")
    ids = ref.encode("Once upon a time") + list(ref.generate("Once upon a time", 45, temperature=0.0))
    ids = ids[:50]
    a, b = ref.logits(ids), nat.logits(ids)
    assert a.shape == b.shape == (50, 512)
    assert np.abs(a - b).max() <= 1e-4 * np.abs(a).max()
    # the decode path (one token at a time) agrees too
    da = list(ref.generate(ids[:5], 40, temperature=0.0))
    db = list(nat.generate(ids[:5], 40, temperature=0.0))
    assert da == db


@needs_shared
@pytest.mark.parametrize("case", RUNC, ids=[f"{c['prompt'][:12]!r}-seed{c['seed']}" for c in RUNC])
def test_llvm_reproduces_runc(case):
    m = runtime.load(MODELS / "stories260K.bin", MODELS / "tok512.bin", backend="llvm", threads=2,
                     kv_type="f32")   # run.c's cache
    n = case["steps"] - len(case["prompt_ids"]) + 1
    got = list(m.generate(case["prompt_ids"], n, temperature=case["temperature"], top_p=case["top_p"],
                          seed=case["seed"]))
    assert got == case["generated_ids"]


@needs_shared
def test_q8_checkpoint_runs_native():
    interp = runtime.load(MODELS / "stories260K-q8.bin", MODELS / "tok512.bin", backend="interp", kv_type="f32")
    nat = runtime.load(MODELS / "stories260K-q8.bin", MODELS / "tok512.bin", backend="llvm", kv_type="f32")
    ids = interp.encode("Lily and Tom went to the park")
    a, b = interp.logits(ids), nat.logits(ids)
    assert np.abs(a - b).max() <= 1e-4 * np.abs(a).max()


def test_arena_plans_are_sound():
    m = load_model(DEFAULT_MODEL, DEFAULT_TOKENIZER)
    from compiler.driver import build_graphs

    for name, g in build_graphs(m).items():
        p = plan_arena(g, {"T": 128})
        check_plan(p)
        assert p.lower_bound <= p.size <= p.no_sharing


def test_compile_then_run_artifact(tmp_path):
    art = tmp_path / "s.lmca"
    r = lmc("compile", DEFAULT_MODEL, "-z", DEFAULT_TOKENIZER, "-o", str(art))
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["artifact"] == str(art) and art.stat().st_size == info["bytes"]
    r = lmc("run", str(art), "-p", "Once upon a time", "-n", "20", "--temp", "0", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    direct = lmc("run", DEFAULT_MODEL, "-z", DEFAULT_TOKENIZER, "-p", "Once upon a time", "-n", "20", "--temp",
                 "0", "--json", "--backend", "interp")
    assert out["generated_ids"] == json.loads(direct.stdout)["generated_ids"]
    man = Artifact.read(art).manifest
    assert man["model"]["size"] == os.path.getsize(DEFAULT_MODEL)
    assert man["target"]["cpu"] and man["lmc_version"]


def _err_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def test_bad_artifacts(tmp_path):
    m = load_model(DEFAULT_MODEL, DEFAULT_TOKENIZER)
    art = compile_native(m, NativeOptions(use_cache=False)).artifact
    good = tmp_path / "good.lmca"
    art.write(good)
    data = good.read_bytes()
    (tmp_path / "cut.lmca").write_bytes(data[: len(data) // 2])
    assert "cut.lmca" in _err_line(lmc("run", str(tmp_path / "cut.lmca"), "-p", "x"))
    flipped = bytearray(data)
    flipped[len(data) // 3] ^= 0xFF
    (tmp_path / "flip.lmca").write_bytes(bytes(flipped))
    assert "corrupt" in _err_line(lmc("run", str(tmp_path / "flip.lmca"), "-p", "x"))
    # built for another CPU
    other = Artifact(dict(art.manifest, target={**art.manifest["target"], "cpu": "some-other-cpu"}), art.obj)
    other.write(tmp_path / "cpu.lmca")
    assert "some-other-cpu" in _err_line(lmc("run", str(tmp_path / "cpu.lmca"), "-p", "x"))
    # built for another model file
    moved = Artifact(dict(art.manifest, model={**art.manifest["model"], "sha256": "0" * 64}), art.obj)
    moved.write(tmp_path / "model.lmca")
    assert "another model file" in _err_line(lmc("run", str(tmp_path / "model.lmca"), "-p", "x"))
    with pytest.raises(ArtifactError, match="not an lmc artifact"):
        Artifact.from_bytes(b"\0" * 100, "zeros")
    out = tmp_path / "no" / "such" / "dir.lmca"
    assert "cannot write the artifact" in _err_line(lmc("compile", DEFAULT_MODEL, "-z", DEFAULT_TOKENIZER,
                                                         "-o", str(out)))
    assert not out.parent.exists()


def test_cache_hit_and_corrupt_entry_rebuilt(tmp_path, private_cache):
    from compiler import cache

    m = load_model(DEFAULT_MODEL, DEFAULT_TOKENIZER)
    cold = compile_native(m)
    assert not cold.cached and cold.cache_path and os.path.exists(cold.cache_path)
    warm = compile_native(m)
    assert warm.cached and warm.artifact.obj == cold.artifact.obj
    with open(cold.cache_path, "r+b") as f:
        f.seek(100)
        f.write(b"garbage!")
    again = compile_native(m)
    assert not again.cached
    assert Artifact.read(cache.cache_path(cold.artifact.manifest["cache_key"])).obj == cold.artifact.obj


def test_warm_run_does_not_invoke_llvm(tmp_path):
    """With the cache warm, a run links the cached object code and never
    optimises or generates code (compile_ir must not be called)."""
    env = {"LMC_CACHE_DIR": str(tmp_path / "c")}
    assert lmc("run", DEFAULT_MODEL, "-z", DEFAULT_TOKENIZER, "-p", "x", "-n", "2", env=env).returncode == 0
    code = ("import compiler.codegen.jit as j, sys\n"
            "def boom(*a, **k): raise SystemExit('LLVM was invoked')\n"
            "j.compile_ir = boom\n"
            "import compiler.native as n; n.emit_object = boom\n"
            f"from runtime.cli import main; sys.exit(main(['run', {DEFAULT_MODEL!r}, '-z', {DEFAULT_TOKENIZER!r}, "
            "'-p', 'x', '-n', '2', '--temp', '0']))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, **env}, timeout=300)
    assert r.returncode == 0, r.stderr


def test_dropped_models_stop_their_workers():
    """Workers must stop before their code and buffers are freed (dropping
    models used to crash a later test), and leave no thread behind."""
    import gc
    import threading

    before = threading.active_count()
    for _ in range(4):   # (3 threads on CI's 2 cores: each round costs seconds of spinning workers)
        m = runtime.load(DEFAULT_MODEL, DEFAULT_TOKENIZER, threads=3)
        assert len(list(m.generate("Once", 5, temperature=0.0))) == 5
        del m
        gc.collect()
    assert threading.active_count() == before


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux /proc to see thread states")
def test_idle_workers_sleep():
    import time

    m = runtime.load(DEFAULT_MODEL, DEFAULT_TOKENIZER, threads=2)
    list(m.generate("Once", 5, temperature=0.0))
    worker = m.executor._threads[0].native_id
    state = ""
    for _ in range(100):  # the worker spins briefly, then sleeps in futex_wait
        time.sleep(0.01)
        state = open(f"/proc/self/task/{worker}/stat").read().rsplit(")", 1)[1].split()[0]
        if state == "S":
            break
    assert state == "S"
