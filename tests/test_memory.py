"""Memory: the arena planner against the optimum, the budget planner's
choices and messages, the head split, and layer streaming in native code
(outputs unchanged, the I/O split reported)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import numpy as np
import pytest

import runtime
from compiler.codegen.kernels import KernelSig
from compiler.driver import CompileOptions, build_graphs, load_model, model_graph
from ir.interp import new_state, run
from passes.memory_budget import (MiB, BudgetError, ModelSizes, WeightInfo, parse_size, plan_memory,
                                  runtime_floor)
from passes.plan_arena import Interval, _best_fit, check_plan, lower_bound, plan_arena
from runtime.cli import DEFAULT_MODEL, DEFAULT_TOKENIZER
from shared_data import MODELS, ROOT, needs_shared, reference_cases

RUNC = reference_cases("stories260K_runc.json")


# --- arena planning -----------------------------------------------------------------------
def _optimum(ivs: list[Interval]) -> int:
    """The smallest arena by brute force: best fit over every order."""
    import itertools

    return min(_best_fit(list(p))[1] for p in itertools.permutations(ivs))


def test_arena_planner_reaches_the_optimum_on_a_known_interval_set():
    # a case where largest-first is not optimal on its own: the optimum (256)
    # is the lower bound, found by one of the planner's orders
    ivs = [Interval("a", 0, 1, 64), Interval("b", 1, 2, 128), Interval("c", 2, 3, 64),
           Interval("d", 3, 4, 128), Interval("e", 0, 4, 64)]
    opt = _optimum(ivs)
    assert opt == lower_bound(ivs) == 256
    from passes import plan_arena as pa
    best = min(_best_fit(sorted(ivs, key=k))[1] for k in pa._ORDERS.values())
    assert best == opt


def test_every_arena_plan_in_the_suite_is_within_5_percent_of_its_bound(tmp_path):
    from test_gguf_frontend import tiny

    models = [load_model(DEFAULT_MODEL, DEFAULT_TOKENIZER), load_model(tiny(tmp_path, "Q8_0")[0])]
    for m in models:
        for split in (None, {"token_embd": 64}):
            for name, g in build_graphs(m, CompileOptions(backend="llvm", split_rows=split)).items():
                for T in (1, 7, 128):
                    p = plan_arena(g, {"T": T})
                    check_plan(p)
                    assert p.size <= 1.05 * p.lower_bound, (name, T, p.size, p.lower_bound)


# --- the budget planner --------------------------------------------------------------------
def test_parse_size():
    assert parse_size("200M") == 200 * MiB
    assert parse_size("1.5G") == 3 * (1 << 29)
    assert parse_size("512k") == 512 * 1024
    assert parse_size("4096") == 4096
    assert parse_size("64MiB") == 64 * MiB
    for bad in ("", "M", "1.5.2G", "-3M", "10Q", "0"):
        with pytest.raises(BudgetError):
            parse_size(bad)


def _sizes(layers=4, layer_mb=10, head_mb=50, vocab=32000, kv_dim=256) -> ModelSizes:
    w = [WeightInfo(f"blk.{i}.ffn_up", layer_mb * MiB, i, matmul=True) for i in range(layers)]
    w.append(WeightInfo("token_embd", head_mb * MiB, None, looked_up=True, matmul=True))
    w.append(WeightInfo("output_norm", 4096, None))
    return ModelSizes(w, layers, kv_dim, 64, vocab, 2048, MiB, MiB, 4, 4096)


def test_budget_planner_prefers_resident_then_layers_then_head():
    s = _sizes()
    floor = runtime_floor(s.vocab_size, s.code_bytes)
    p = plan_memory(s, 10 << 30, threads=2)
    assert not p.streaming and p.kv_type == "f16" and p.ctx == 2048
    full = p.total
    p = plan_memory(s, full - 1, threads=2)      # one byte less: stream (exact) before a lossy KV cache
    assert p.stream_layers and not p.stream_head and p.kv_type == "f16" and p.ctx == 2048
    # streaming everything at the full context does not fit: a shorter f16 context before q8
    every = {c: plan_memory(s, None, threads=2, stream="all", ctx=c, kv_type="f16").total for c in (2048, 256)}
    p = plan_memory(s, every[2048] - 1, threads=2)
    assert p.stream_head and p.kv_type == "f16" and p.ctx == 1024 and "shortened" in p.notes[0]
    p = plan_memory(s, every[256] - 1, threads=2)   # f16 does not fit even at 256 positions
    assert p.kv_type == "q8" and p.ctx == 256
    p = plan_memory(s, floor + 60 * MiB + 30 * MiB, threads=2)
    assert p.stream_layers and not p.stream_head and p.total <= floor + 90 * MiB
    p = plan_memory(s, floor + 30 * MiB, threads=2)
    assert p.stream_layers and p.stream_head == ["token_embd"] and p.head_rows
    assert p.total <= floor + 30 * MiB
    # the user's context and KV type are kept, or the budget is refused
    with pytest.raises(BudgetError, match="smallest workable budget"):
        plan_memory(s, floor + 5 * MiB, threads=2, ctx=2048, kv_type="f32")


def test_rings_shrink_the_planned_cache():
    """Sliding-window layers' rings count their own positions, not the context's."""
    s = _sizes()
    ringed = ModelSizes(**{**s.__dict__, "ring_rows": (0, 300, 300, 300)})
    whole = plan_memory(s, None, threads=2)
    p = plan_memory(ringed, None, threads=2)
    per_position = 2 * s.kv_dim * 2       # K and V, f16
    assert whole.categories["kv cache"] == 4 * 2048 * per_position
    assert p.categories["kv cache"] == (2048 + 3 * 300) * per_position
    assert "3 sliding-window layers keep a ring of 300" in p.describe()


def test_a_low_bit_caches_exact_rows_are_counted():
    """Beside a q4 cache each layer keeps its exact rows in f16 (a ring of
    them and the sink row): counted for the low-bit types only."""
    s = ModelSizes(**{**_sizes().__dict__, "exact_ring": 300})
    q4 = plan_memory(s, None, threads=2, kv_type="q4")
    assert q4.categories["kv cache"] == 4 * 2 * s.kv_dim * (2048 * 20 // 32 + 301 * 2)
    assert "last 128 positions and position 0 also in f16 (a ring of 300)" in q4.describe()
    f16 = plan_memory(s, None, threads=2, kv_type="f16")
    assert f16.categories["kv cache"] == 4 * 2048 * 2 * s.kv_dim * 2 and "also in f16" not in f16.describe()
    whole = plan_memory(ModelSizes(**{**s.__dict__, "exact_ring": 0}), None, threads=2, kv_type="q4", ctx=1000)
    assert whole.categories["kv cache"] == 4 * 2 * s.kv_dim * (1000 * 20 // 32 + 1001 * 2)


def test_budget_messages():
    s = _sizes()
    floor = runtime_floor(s.vocab_size, s.code_bytes)
    with pytest.raises(BudgetError, match="below the runtime's own floor"):
        plan_memory(s, floor - 1, threads=1)
    with pytest.raises(BudgetError, match=r"smallest workable budget is [\d.]+ MiB, which streams the layers"):
        plan_memory(s, floor + 1, threads=1)


# --- the head split ------------------------------------------------------------------------
def test_split_rows_keeps_the_interpreters_outputs(tmp_path):
    from test_gguf_frontend import tiny

    m = load_model(tiny(tmp_path, "Q4_0")[0])
    feeds = {"decode": {"token": np.int32(7), "pos": np.int32(0)},
             "prefill": {"tokens": np.array([1, 5, 9, 3, 2], np.int32), "pos": np.int32(0)}}
    for mode, all_logits in (("decode", False), ("prefill", False), ("prefill", True)):
        a = model_graph(m, mode, all_logits=all_logits)
        b = model_graph(m, mode, CompileOptions(split_rows={"token_embd": 64}), all_logits=all_logits)
        blocks = [n for n in b.nodes if n.op == "qmatmul_rows"]
        assert len(blocks) == 5 and not any(n.op == "qmatmul" and n.inputs[1].name == "token_embd"
                                            for n in b.nodes)
        # row0 is the lowering's output offset, not the kernel's: blocks of one height (after the
        # first, which has no result to add to) share a kernel
        shapes = {(len(n.inputs), n.inputs[1].type.shape[0]) for n in blocks}
        assert len({KernelSig.of(n) for n in blocks}) == len(shapes) == 3
        assert "token_embd" in b.weights  # the embedding lookup still reads the whole table
        ra = run(a, feeds[mode], new_state(a))["logits"]
        rb = run(b, feeds[mode], new_state(b))["logits"]
        # BLAS may sum a smaller matrix in another order: float32 rounding only
        assert np.allclose(ra, rb, rtol=1e-5, atol=1e-6 * np.abs(ra).max())
        p = plan_arena(b, {"T": 5})
        check_plan(p)
        offs = {p.offsets[n.output.name] for n in blocks}
        assert len(offs) == 1  # the blocks fill one buffer in place


# --- streaming in native code --------------------------------------------------------------
@pytest.mark.parametrize("qtype,io", [("Q8_0", "pread"), ("Q4_K", "pread"), ("Q4_K", "mmap")])
def test_streamed_native_equals_resident(tmp_path, qtype, io):
    from compiler.native import NativeOptions, compile_native
    from runtime.model import Model
    from test_gguf_frontend import tiny

    loaded = load_model(tiny(tmp_path, qtype)[0])
    res = Model(loaded, "llvm", threads=2, use_cache=False)
    art = compile_native(loaded, NativeOptions(ctx=res.ctx, use_cache=False, stream="all", head_rows=64,
                                                   stream_io=io)).artifact
    st = Model(loaded, "llvm", threads=2, artifact=art)
    mem = art.manifest["memory"]
    names = [s["name"] for s in mem["stream"]["segments"]]
    assert names[:2] == ["layer 0", "layer 1"] and sum(n.startswith("token_embd") for n in names) == 5
    ids = [1, 5, 77, 260, 9, 42, 3]
    a, b = res.logits(ids), st.logits(ids)          # prefill_all: T rows into blocks of the head
    # this head (300 rows) has no repacked form: its row blocks run the file layout's GEMM, whose
    # sums for a block of rows may round apart from the whole head's (repacked weights, which real
    # vocabularies get, give the resident bits: ``test_repack``)
    assert np.allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(a).max())
    ga = list(res.generate(ids, 12, temperature=0.0))
    gb = list(st.generate(ids, 12, temperature=0.0))
    assert ga == gb
    s = st.last_stats.as_dict()
    read = s["read_bytes"]
    per_token = mem["stream"]["read_bytes_per_step"]
    assert read >= per_token * 11  # every decode step read every segment
    assert s["decode_io_wait_s"] >= 0 and s["decode_compute_s"] > 0


@needs_shared
@pytest.mark.parametrize("i", range(len(RUNC)), ids=[f"{c['prompt'][:12]!r}-seed{c['seed']}" for c in RUNC])
def test_streaming_reproduces_runc(i):
    """Layers and head streamed; pread and mmap modes take turns over the cases."""
    case = RUNC[i]
    io = ("pread", "mmap")[i % 2]
    m = runtime.load(MODELS / "stories260K.bin", MODELS / "tok512.bin", threads=2, stream="all", stream_io=io,
                     kv_type="f32")   # run.c's cache
    assert m.executor.stream
    n = case["steps"] - len(case["prompt_ids"]) + 1
    got = list(m.generate(case["prompt_ids"], n, temperature=case["temperature"], top_p=case["top_p"],
                          seed=case["seed"]))
    assert got == case["generated_ids"]


# --- the CLI --------------------------------------------------------------------------------
def lmc(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runtime.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)


def test_plan_command_formats(tmp_path):
    base = ["plan", DEFAULT_MODEL, "-z", DEFAULT_TOKENIZER]
    r = lmc(*base, "--stream", "all", "--format", "json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert set(d["categories"]) == {"resident weights", "stream buffers", "kv cache", "activation arena",
                                    "scratch", "runtime"}
    assert d["total"] == sum(d["categories"].values())
    assert d["stream"]["segments"][0]["name"] == "layer 0"
    for a in d["arenas"].values():
        assert a["lower_bound"] <= a["size"] <= a["no_sharing"]
    r = lmc(*base, "--format", "text")
    assert r.returncode == 0 and "kv cache" in r.stdout and "lower bound" in r.stdout
    svg = tmp_path / "arena.svg"
    r = lmc(*base, "--format", "svg", "-o", str(svg))
    assert r.returncode == 0, r.stderr
    root = ET.parse(svg).getroot()
    rects = [e for e in root.iter() if e.tag.endswith("rect")]
    g = model_graph(load_model(DEFAULT_MODEL, DEFAULT_TOKENIZER), "decode",
                    CompileOptions(backend="llvm"))
    assert len(rects) == 1 + len(plan_arena(g).intervals)  # the frame, then a box per buffer


@pytest.mark.parametrize("args,msg", [
    (["--mem-budget", "12X"], "not a size"),
    (["--mem-budget", "1M"], "below the runtime's own floor"),
    (["--mem-budget", "38.5M", "-c", "512", "--kv-type", "f32"], "smallest workable budget"),
])
def test_bad_budgets_get_one_line(args, msg):
    for cmd in ("plan", "run"):
        r = lmc(cmd, DEFAULT_MODEL, "-z", DEFAULT_TOKENIZER, *args)
        assert r.returncode == 2, (cmd, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert msg in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert len(lines) == 1 or lines[0].startswith("usage:"), r.stderr


def test_a_budget_keeps_the_greedy_tokens_of_a_real_model(tmp_path):
    """``lmc run`` under ``--mem-budget`` (layers streamed from disk) prints
    what the unbudgeted run prints: the streamed weights are repacked and
    take the resident kernels. Qwen2.5-Coder: 392 MB of weights per token,
    run in 250 MB."""
    from shared_data import QWEN, instruct_models

    path = instruct_models()[QWEN]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LMC_CACHE_DIR": str(tmp_path / "cache")}

    def run_lmc(*extra: str) -> dict:
        r = subprocess.run([sys.executable, "-m", "runtime.cli", "run", path, "-p", "def quicksort(xs):", "-n", "32",
                            "--temp", "0", "-t", "2", "--json", *extra], capture_output=True, text=True, env=env,
                           timeout=1200)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    free, budget = run_lmc(), run_lmc("--mem-budget", "250M")
    assert budget["stats"].get("read_bytes", 0) > 0          # it streamed
    assert budget["generated_ids"] == free["generated_ids"] and len(free["generated_ids"]) == 32
