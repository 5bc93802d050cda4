"""How many cores this process may really use: the default for every thread
count and worker pool (model threads, serving pools, compile workers,
Ray replicas).

``os.cpu_count()`` counts the machine's cores, not this process's: under
``taskset -c 0``, a container's cpuset or a CPU quota (``docker --cpus``,
a Kubernetes limit) lmc started one model thread per machine core, and
threads that wait for each other at every op, more of them than cores,
wait a scheduler slice at many ops (SmolLM2 under ``taskset -c 0``,
Emerald Rapids: prefill 681 tok/s with 2 threads, 1,389 with 1). As
the JVM and Go (1.25) do, the count is the smaller of the CPUs in the
affinity mask and the cgroup's quota (cgroup v2 ``cpu.max``, v1
``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, on the process's cgroup and
its ancestors), rounded up, and at least 1.
"""
from __future__ import annotations

import math
import os

#: where the cgroup filesystems are mounted (a parameter for tests)
CGROUP_ROOT = "/sys/fs/cgroup"


def usable_cores(cgroup_root: str = CGROUP_ROOT, proc_cgroup: str = "/proc/self/cgroup") -> int:
    """Cores this process may use: affinity mask, then any CPU quota."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    quota = cpu_quota(cgroup_root, proc_cgroup)
    if quota is not None:
        n = min(n, max(1, math.ceil(quota)))
    return max(1, n)


def cpu_quota(cgroup_root: str = CGROUP_ROOT, proc_cgroup: str = "/proc/self/cgroup") -> float | None:
    """The tightest CPU quota (in cores) on this process's cgroup or an
    ancestor, or None where none is set or none can be read."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    found: list[float] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":                                   # cgroup v2: "0::/path"
            for d in _ancestors(os.path.join(cgroup_root, path.lstrip("/")), stop=cgroup_root):
                q = _v2_quota(os.path.join(d, "cpu.max"))
                if q is not None:
                    found.append(q)
        elif "cpu" in controllers.split(","):                   # cgroup v1: "N:cpu,cpuacct:/path"
            mount = next((os.path.join(cgroup_root, m) for m in ("cpu", "cpu,cpuacct", "cpuacct,cpu")
                          if os.path.isdir(os.path.join(cgroup_root, m))), None)
            if mount is None:
                continue
            for d in _ancestors(os.path.join(mount, path.lstrip("/")), stop=mount):
                q = _v1_quota(d)
                if q is not None:
                    found.append(q)
    return min(found) if found else None


def _ancestors(d: str, stop: str) -> list[str]:
    """``d`` and its parents up to the mount point ``stop``."""
    stop = os.path.normpath(stop)
    d = os.path.normpath(d)
    out = [d]
    while d != stop and len(d) > len(stop):
        d = os.path.dirname(d)
        out.append(d)
    return out


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _v2_quota(path: str) -> float | None:
    text = _read(path)                     # "max 100000" or "150000 100000"
    if not text:
        return None
    parts = text.split()
    try:
        if parts[0] == "max" or len(parts) != 2:
            return None
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _v1_quota(d: str) -> float | None:
    quota, period = _read(os.path.join(d, "cpu.cfs_quota_us")), _read(os.path.join(d, "cpu.cfs_period_us"))
    try:
        q, p = int(quota or -1), int(period or 0)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None
