"""The kernel cache: kernels shared between models, damaged entries
recompiled, concurrent writers. Counts, never timings, decide."""
from __future__ import annotations

import glob
import multiprocessing
import os
import subprocess
import sys

import numpy as np
import pytest

import runtime
from compiler import kernel_cache, objpack
from compiler.codegen.kernels import KernelSig
from compiler.driver import load_model
from compiler.native import NativeOptions, compile_native
from frontends.arch import ModelConfig
from frontends.gguf_writer import write_gguf
from frontends.synth import synth_tensor
from shared_data import ROOT


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("LMC_CACHE_DIR", str(d))
    return d


def _model(tmp_path, name: str, **kw):
    base = dict(arch="llama", dim=64, hidden_dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=300,
                seq_len=32)
    base.update(kw)
    cfg = ModelConfig(**base)
    p = tmp_path / name
    write_gguf(p, cfg, lambda n: synth_tensor(cfg, n, 1), "Q8_0")
    return str(p)


def _sigs(res) -> set:
    return {KernelSig.of(n) for g in res.graphs.values() for n in g.nodes}


def _entries(cache) -> list[str]:
    return sorted(glob.glob(os.path.join(str(cache), "kernels", "*.o")))


@pytest.mark.parametrize("jobs", [1, 2])
def test_second_model_compiles_only_new_kernels(tmp_path, private_cache, jobs):
    a = compile_native(load_model(_model(tmp_path, "a.gguf")), NativeOptions(jobs=jobs))
    assert not a.cached and a.kernels.compiled == a.kernels.total == len(_sigs(a)) and a.kernels.cached == 0
    assert len(_entries(private_cache)) == a.kernels.total
    # same family and width, another FFN size: the FFN kernels are new, the rest shared
    b = compile_native(load_model(_model(tmp_path, "b.gguf", hidden_dim=192)), NativeOptions(jobs=jobs))
    shared, new = _sigs(b) & _sigs(a), _sigs(b) - _sigs(a)
    assert shared and new
    assert b.kernels.cached == len(shared) and b.kernels.compiled == len(new)
    assert b.kernels.total == len(_sigs(b)) and b.kernels.corrupt == 0
    assert len(_entries(private_cache)) == len(_sigs(a) | _sigs(b))
    # another context length of model a: a new artifact; only the kernels whose shapes hold the
    # context (KV cache, attention) are new
    c = compile_native(load_model(_model(tmp_path, "a.gguf")), NativeOptions(ctx=16, jobs=jobs))
    assert not c.cached and c.kernels.cached == len(_sigs(c) & (_sigs(a) | _sigs(b)))


def test_shared_kernels_compute_what_a_fresh_compile_does(tmp_path, private_cache):
    """A model linked from cached kernels gives the logits of one compiled
    from scratch (--no-cache compiles every kernel anew)."""
    path = _model(tmp_path, "a.gguf")
    _model_b = _model(tmp_path, "b.gguf", hidden_dim=192)
    compile_native(load_model(_model_b), NativeOptions())   # fills the cache with the shared kernels
    warm = runtime.load(path, threads=2)
    assert warm.compile_info["kernels_cached"] > 0
    fresh = runtime.load(path, threads=2, use_cache=False)
    assert fresh.compile_info["kernels_cached"] == 0
    ids = [1, 5, 9, 200, 3]
    assert np.array_equal(warm.logits(ids), fresh.logits(ids))


def test_damaged_kernel_entries_are_recompiled_never_loaded(tmp_path, private_cache):
    path = _model(tmp_path, "a.gguf")
    first = compile_native(load_model(path), NativeOptions(jobs=1))
    entries = _entries(private_cache)
    assert len(entries) == first.kernels.total >= 3
    flipped, cut, emptied = entries[:3]
    data = bytearray(open(flipped, "rb").read())
    data[-5] ^= 0x40                      # one bit of the object code
    open(flipped, "wb").write(bytes(data))
    open(cut, "wb").write(open(cut, "rb").read()[:-100])   # truncated
    open(emptied, "wb").close()
    for f in glob.glob(os.path.join(str(private_cache), "*.lmca")):
        os.remove(f)                      # the artifact itself must be rebuilt from kernels
    again = compile_native(load_model(path), NativeOptions(jobs=1))
    assert again.kernels.corrupt == 3 and again.kernels.compiled == 3
    assert again.kernels.cached == first.kernels.total - 3
    # the rebuilt artifact holds exactly the first build's code, entries are whole again
    assert objpack.unpack(again.artifact.obj)[1:] == objpack.unpack(first.artifact.obj)[1:]
    for e in entries:
        key = os.path.basename(e)[:-2]
        assert kernel_cache.decode(key, open(e, "rb").read()) is not None


def test_entry_format_refuses_other_keys_and_damage():
    obj = b"\x7fELF" + bytes(range(200))
    data = kernel_cache.encode("a" * 32, obj)
    assert kernel_cache.decode("a" * 32, data) == obj
    assert kernel_cache.decode("b" * 32, data) is None            # renamed into another key's place
    assert kernel_cache.decode("a" * 32, data[:-1]) is None       # truncated
    assert kernel_cache.decode("a" * 32, data[: len(kernel_cache.MAGIC) + 40]) is None
    assert kernel_cache.decode("a" * 32, data[:-1] + b"\0") is None


def _hammer(cache: str, key: str, n: int, seed: int, out) -> None:
    """Store and read one key over and over; report any damaged read."""
    os.environ["LMC_CACHE_DIR"] = cache
    bad = 0
    for i in range(n):
        kernel_cache.store(key, bytes([seed]) * (1000 + 37 * (i % 50)))
        obj, corrupt = kernel_cache.load(key)
        bad += corrupt
    out.put(bad)


def test_concurrent_writers_never_expose_half_an_entry(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_hammer, args=(str(tmp_path), "c" * 32, 300, s, q)) for s in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * 4
    assert sum(q.get(timeout=10) for _ in procs) == 0
    assert not glob.glob(os.path.join(str(tmp_path), "kernels", "*.part"))


def test_concurrent_compiles_fill_one_cache(tmp_path, monkeypatch):
    """Three processes compile the same model into one empty cache at once:
    all succeed, every entry is intact, and a fourth compile finds every
    kernel (and the artifact) cached."""
    path = _model(tmp_path, "a.gguf")
    cache = str(tmp_path / "shared-cache")
    code = ("import sys; from compiler.driver import load_model; "
            "from compiler.native import NativeOptions, compile_native; "
            "r = compile_native(load_model(sys.argv[1]), NativeOptions(jobs=1)); "
            "print(r.kernels.total if r.kernels else 0)")
    env = {**os.environ, "LMC_CACHE_DIR": cache, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", code, path], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [o[1] for o in outs]
    entries = _entries(cache)
    assert entries and not glob.glob(os.path.join(cache, "kernels", "*.part"))
    for e in entries:
        assert kernel_cache.decode(os.path.basename(e)[:-2], open(e, "rb").read()) is not None
    monkeypatch.setenv("LMC_CACHE_DIR", cache)
    for f in glob.glob(os.path.join(cache, "*.lmca")):
        os.remove(f)
    again = compile_native(load_model(path), NativeOptions(jobs=1))
    assert again.kernels.compiled == 0 and again.kernels.cached == again.kernels.total == len(entries)


def test_pack_round_trip_and_damage():
    objs = [b"a", b"", b"\x7fELF" * 33, bytes(range(7))]
    blob = objpack.pack(objs)
    assert objpack.is_pack(blob) and objpack.unpack(blob) == objs
    assert objpack.unpack(b"\x7fELF plain") == [b"\x7fELF plain"]   # one object (artifact format 1)
    with pytest.raises(objpack.PackError):
        objpack.unpack(blob[:-3])


def test_format_1_artifacts_still_load_and_run(tmp_path, private_cache):
    """An artifact from before kernels were compiled apart (format 1: one
    object with every kernel inside) still reads, links and computes what
    the packed one does."""
    from compiler.artifact import Artifact
    from compiler.codegen.jit import emit_object
    from compiler.codegen.lower import lower_graphs
    from compiler.codegen.target import host_target
    from compiler.native import plan_native
    from runtime.native import NativeExecutor

    path = _model(tmp_path, "a.gguf")
    m = load_model(path)
    new = compile_native(m, NativeOptions(ctx=32)).artifact
    assert objpack.is_pack(new.obj) and new.manifest["format_version"] == 3
    planned = plan_native(m, NativeOptions(ctx=32))
    module, *_ = lower_graphs(planned.graphs, planned.plans, host_target(), symbols=planned.symbols)
    old = Artifact({**new.manifest, "format_version": 1}, emit_object(module))
    assert not objpack.is_pack(old.obj)
    old.write(tmp_path / "old.lmca")
    back = Artifact.read(tmp_path / "old.lmca")
    ids = [1, 7, 42]
    a, b = NativeExecutor(back, path, 1), NativeExecutor(new, path, 1)
    assert np.array_equal(a.prefill(ids, 0), b.prefill(ids, 0))
