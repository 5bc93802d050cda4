"""What a cold start tells the user: kernel progress on the status line,
and ``lmc plan``'s estimate of the one-time compile's memory."""
from __future__ import annotations

import io
import json
import subprocess
import sys

import numpy as np

from compiler.codegen.kernels import KernelSig
from compiler.codegen.target import host_target
from compiler.compile_memory import LLVM_COMPILE_BYTES
from compiler.driver import load_model
from compiler.kernel_build import KernelBuild
from compiler.native import NativeOptions, codegen_fingerprint, plan_native
from runtime.cli import DEFAULT_MODEL, DEFAULT_TOKENIZER
from runtime.status import StatusLine
from shared_data import ROOT


def test_status_update_keeps_the_clock_running():
    out = io.StringIO()
    s = StatusLine(stream=out, enabled=True, interval=60)
    s("compiling")
    t0 = s._t0
    s.update("compiling: kernel 3/9")
    assert s._t0 == t0 and out.getvalue().endswith("compiling: kernel 3/9 …")
    s.clear()
    assert out.getvalue().endswith("\r\x1b[2K")


def test_kernel_build_reports_each_kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("LMC_CACHE_DIR", str(tmp_path))
    planned = plan_native(load_model(DEFAULT_MODEL, DEFAULT_TOKENIZER), NativeOptions(ctx=32))
    sigs = list(dict.fromkeys(KernelSig.of(n) for g in planned.graphs.values() for n in g.nodes))
    t = host_target()
    said: list[str] = []
    KernelBuild(sigs, t, t.vector_width, 3, codegen_fingerprint(), jobs=1, progress=said.append).finish()
    n = len(sigs)
    assert said[0].endswith(f"kernel 0/{n}") and said[-1].endswith(f"kernel {n}/{n}") and len(said) == n + 1
    said.clear()
    KernelBuild(sigs, t, t.vector_width, 3, codegen_fingerprint(), jobs=1, progress=said.append).finish()
    assert said == [f"compiling for this CPU, once: kernel {n}/{n}, {n} from the kernel cache"]


def test_plan_estimates_the_compile_peak():
    r = subprocess.run([sys.executable, "-m", "runtime.cli", "plan", DEFAULT_MODEL, "-z", DEFAULT_TOKENIZER,
                        "--mem-budget", "100M", "--format", "json"], capture_output=True, text=True, cwd=ROOT,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["compile_peak_estimate"] > LLVM_COMPILE_BYTES
    assert any("one-time compile" in n for n in d["notes"])   # LLVM alone does not fit 100 MB


def test_budget_compile_reports_the_childs_kernels(tmp_path, monkeypatch):
    """Under a budget the compile runs in a child process; its kernel
    progress still reaches the status line, and the stats give its peak."""
    import runtime

    monkeypatch.setenv("LMC_CACHE_DIR", str(tmp_path))
    said: list[str] = []
    # a budget the compile fits (a smaller one is refused: the next test)
    m = runtime.load(DEFAULT_MODEL, DEFAULT_TOKENIZER, mem_budget=600 << 20, status=said.append)
    kernels = [s for s in said if "kernel " in s]
    assert kernels and all("child process" in s for s in kernels)
    n = kernels[-1].split("kernel ")[1].split("/")[1].split()[0]
    assert kernels[-1].split("kernel ")[1].startswith(f"{n}/{n}")
    assert not m.compile_info["cache_hit"] and m.compile_info["compile_child_peak_bytes"] > 0


def test_the_callers_memory_is_not_the_compile_childs(tmp_path, monkeypatch):
    """The compile child's need is its own (a process with the model loaded,
    plus LLVM), not the caller's resident set: a caller holding 2 GiB still
    compiles under a 600M budget. (Judged by the caller's resident set,
    this test's neighbour failed whenever it ran in a pytest worker that
    earlier tests had grown to 3 GiB.)"""
    import runtime

    monkeypatch.setenv("LMC_CACHE_DIR", str(tmp_path))
    ballast = np.ones((2 << 30) // 8)      # 2 GiB, resident
    m = runtime.load(DEFAULT_MODEL, DEFAULT_TOKENIZER, mem_budget=600 << 20)
    assert not m.compile_info["cache_hit"] and 0 < m.compile_info["compile_child_peak_bytes"] < 600 << 20
    assert ballast[-1] == 1.0


def test_a_budget_the_compile_cannot_fit_is_refused_then_compile_once(tmp_path):
    """Cold, with a budget below what LLVM needs: one line naming the flag,
    the need and the way (``lmc compile``), exit 2, nothing compiled. After
    that ``lmc compile``, the same ``lmc run`` finds the cached code and its
    run stays within the budget (no LLVM: not even sampling's softmax)."""
    import os

    env = {**os.environ, "LMC_CACHE_DIR": str(tmp_path / "cache")}
    run = [sys.executable, "-m", "runtime.cli", "run", DEFAULT_MODEL, "-z", DEFAULT_TOKENIZER, "-n", "8",
           "-p", "Once", "-t", "1", "--mem-budget", "90M"]
    r = subprocess.run(run, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert r.returncode == 2 and r.stdout == ""
    line = r.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    assert line.startswith("lmc: error: --mem-budget 90.0 MiB: compiling ") and "lmc compile " in line
    assert f"--mem-budget 90M -t 1 -z {DEFAULT_TOKENIZER} -o " in line
    assert not os.path.exists(tmp_path / "cache" / "kernels")
    art = tmp_path / "m.lmc"
    c = subprocess.run([sys.executable, "-m", "runtime.cli", "compile", DEFAULT_MODEL, "-z", DEFAULT_TOKENIZER,
                        "--mem-budget", "90M", "-t", "1", "-o", str(art)], capture_output=True, text=True, cwd=ROOT, env=env,
                       timeout=900)
    assert c.returncode == 0, c.stderr
    # measured in a fresh interpreter: this test process's children so far were larger
    probe = ("import subprocess, sys, resource, json; r = subprocess.run(sys.argv[1:], capture_output=True, "
             "text=True); print(json.dumps([r.returncode, r.stdout, r.stderr, "
             "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss]))")
    for cmd in (run, [*run[:4], str(art), *run[7:-2]], [*run[:4], str(art), *run[7:]]):
        code, out, err, kb = json.loads(subprocess.run([sys.executable, "-c", probe, *cmd], capture_output=True,
                                                       text=True, cwd=ROOT, env=env, timeout=900).stdout)
        assert code == 0, err
        assert out.startswith("Once")
        assert kb * 1024 <= 90 << 20, f"{cmd}: peak {kb} KiB over the 90M budget"
    # the artifact under a budget smaller than the plan it was compiled for: refused, not exceeded
    small = subprocess.run([*run[:4], str(art), *run[7:-1], "30M"], capture_output=True, text=True, cwd=ROOT,
                           env=env, timeout=900)
    line = small.stderr.strip()
    assert small.returncode == 2 and small.stdout == "" and "\n" not in line and "Traceback" not in line
    assert line.startswith("lmc: error: --mem-budget 30.0 MiB: this compiled model was planned for "), line
