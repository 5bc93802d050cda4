"""The default thread count is the cores this process may use (its affinity
mask and its cgroup's CPU quota), not the machine's: checked through
``lmc bench --json``'s ``threads`` in a child process confined each way,
and the quota files' parsing on cgroup trees written to disk."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from compiler.host_cores import cpu_quota, usable_cores
from runtime.models import BUNDLED_MODEL, BUNDLED_TOKENIZER

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = [sys.executable, "-m", "runtime.cli", "bench", BUNDLED_MODEL, "-z", BUNDLED_TOKENIZER,
         "--prompt-tokens", "8", "--gen-tokens", "4", "--runs", "1", "--json"]


def _bench_threads(preexec=None) -> int:
    r = subprocess.run(BENCH, cwd=ROOT, capture_output=True, text=True, timeout=600, preexec_fn=preexec)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)["threads"]


@pytest.fixture
def two_cores(whole_machine):
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs a process allowed on 2 or more cores")
    if cpu_quota() is not None and cpu_quota() < 2:
        pytest.skip(f"this process's cgroup already limits it to {cpu_quota():g} CPUs")
    return sorted(os.sched_getaffinity(0))


def test_default_threads_follow_the_affinity_mask(two_cores):
    # the whole machine: one thread per core; pinned to one core (taskset -c N): one thread
    assert _bench_threads() == len(two_cores)
    assert _bench_threads(lambda: os.sched_setaffinity(0, two_cores[:1])) == 1


def _v1_cpu_mount() -> str | None:
    for m in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        d = os.path.join("/sys/fs/cgroup", m)
        if os.path.isfile(os.path.join(d, "cpu.cfs_quota_us")):
            return d
    return None


def test_default_threads_follow_a_cgroup_cpu_quota(two_cores):
    """A real cgroup (v1 cpu controller) with a quota of one CPU, as ``docker
    --cpus 1`` makes: the child joins it before it starts."""
    mount = _v1_cpu_mount()
    if mount is None:
        pytest.skip("no cgroup v1 cpu controller mounted (a v2-only host: the parsing test covers cpu.max)")
    with open("/proc/self/cgroup") as f:
        mine = next((ln.split(":", 2)[2] for ln in f.read().splitlines()
                     if "cpu" in ln.split(":", 2)[1].split(",")), None)
    if mine is None:
        pytest.skip("this process is in no cgroup v1 cpu hierarchy")
    group = os.path.join(mount, mine.lstrip("/"), f"lmc-test-{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(group)
        with open(os.path.join(group, "cpu.cfs_period_us"), "w") as f:
            f.write("100000")
        with open(os.path.join(group, "cpu.cfs_quota_us"), "w") as f:
            f.write("100000")
    except OSError as e:
        pytest.skip(f"cannot make a cgroup with a CPU quota here ({e.strerror})")
    try:
        def join() -> None:
            with open(os.path.join(group, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        assert _bench_threads(join) == 1
    finally:
        os.rmdir(group)


def _write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_quota_files_v2(tmp_path):
    root = tmp_path / "cg"
    _write(tmp_path / "self", "0::/a/b\n")
    _write(root / "cpu.max", "max 100000\n")            # the root: no quota
    _write(root / "a" / "cpu.max", "250000 100000\n")   # 2.5 CPUs on the parent
    _write(root / "a" / "b" / "cpu.max", "max 100000\n")
    assert cpu_quota(str(root), str(tmp_path / "self")) == 2.5
    _write(root / "a" / "b" / "cpu.max", "50000 100000\n")   # the tighter one wins
    assert cpu_quota(str(root), str(tmp_path / "self")) == 0.5
    # a quota under one CPU still gets one thread, and never more than the affinity allows
    assert usable_cores(str(root), str(tmp_path / "self")) == 1


def test_quota_files_v1_and_none(tmp_path):
    root = tmp_path / "cg"
    _write(tmp_path / "self", "4:memory:/x\n3:cpu,cpuacct:/docker/c1\n")
    _write(root / "cpu,cpuacct" / "cpu.cfs_quota_us", "-1\n")
    _write(root / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    _write(root / "cpu,cpuacct" / "docker" / "c1" / "cpu.cfs_quota_us", "150000\n")
    _write(root / "cpu,cpuacct" / "docker" / "c1" / "cpu.cfs_period_us", "100000\n")
    assert cpu_quota(str(root), str(tmp_path / "self")) == 1.5
    assert usable_cores(str(root), str(tmp_path / "self")) == min(2, len(os.sched_getaffinity(0)))
    # no quota anywhere, unreadable or garbled files: no limit from the cgroup
    _write(root / "cpu,cpuacct" / "docker" / "c1" / "cpu.cfs_quota_us", "-1\n")
    assert cpu_quota(str(root), str(tmp_path / "self")) is None
    _write(tmp_path / "v2", "0::/a\n")
    _write(root / "a" / "cpu.max", "garbage\n")
    assert cpu_quota(str(root), str(tmp_path / "v2")) is None
    assert cpu_quota(str(root), str(tmp_path / "missing")) is None
    assert usable_cores(str(root), str(tmp_path / "missing")) == len(os.sched_getaffinity(0))
