"""The warm-start memo: a model compiled before is found without planning,
and nothing that changes the plan can be served another plan's artifact."""
from __future__ import annotations

import dataclasses
import glob
import os

import pytest

from compiler.driver import load_model
from compiler.native import NativeOptions, compile_native
from runtime.cli import DEFAULT_MODEL, DEFAULT_TOKENIZER


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LMC_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _model():
    return load_model(DEFAULT_MODEL, DEFAULT_TOKENIZER)


def test_warm_start_skips_planning(private_cache):
    cold = compile_native(_model(), NativeOptions(ctx=64))
    assert not cold.cached and cold.graphs is not None
    warm = compile_native(_model(), NativeOptions(ctx=64))
    assert warm.cached and warm.graphs is None    # found through the memo: nothing planned
    assert warm.artifact.obj == cold.artifact.obj
    # a profile build needs its graphs: it plans (and is another artifact)
    prof = compile_native(_model(), NativeOptions(ctx=64, profile=True))
    assert prof.graphs is not None


def test_anything_that_changes_the_plan_misses(private_cache):
    base = compile_native(_model(), NativeOptions(ctx=64))
    other_ctx = compile_native(_model(), NativeOptions(ctx=32))
    assert not other_ctx.cached and other_ctx.artifact.manifest["ctx"] == 32
    other_kv = compile_native(_model(), NativeOptions(ctx=64, kv_type="f32"))   # f16 is the default
    assert not other_kv.cached and other_kv.artifact.manifest["kv_type"] == "f32"
    # the same file with fewer layers (a self-speculative draft builds one so)
    m = _model()
    m.config = dataclasses.replace(m.config, n_layers=m.config.n_layers - 1)
    m.weights = {k: v for k, v in m.weights.items() if not k.startswith(f"blk.{m.config.n_layers}.")
                 and not k.startswith(f"layers.{m.config.n_layers}.")}
    fewer = compile_native(m, NativeOptions(ctx=64))
    assert not fewer.cached and fewer.artifact.manifest["config"]["n_layers"] == m.config.n_layers
    assert base.artifact.manifest["config"]["n_layers"] == m.config.n_layers + 1


def test_a_touched_model_file_misses_the_memo(private_cache, tmp_path):
    import shutil

    path = tmp_path / "model.bin"
    shutil.copy(DEFAULT_MODEL, path)
    compile_native(load_model(str(path), DEFAULT_TOKENIZER), NativeOptions(ctx=64))
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    again = compile_native(load_model(str(path), DEFAULT_TOKENIZER), NativeOptions(ctx=64))
    # the memo missed, so it planned; the plan's key still finds the artifact
    assert again.cached and again.graphs is not None


def test_a_damaged_memo_entry_is_a_miss(private_cache):
    compile_native(_model(), NativeOptions(ctx=64))
    for f in glob.glob(os.path.join(str(private_cache), "memo", "*.json")):
        with open(f, "w") as fh:
            fh.write("{not json")
    again = compile_native(_model(), NativeOptions(ctx=64))
    assert again.cached and again.graphs is not None
