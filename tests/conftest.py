"""Test-session setup: a private compile cache, so tests never touch (or
depend on) the user's ~/.cache/lmc; and how many pytest-xdist workers
``-n auto`` starts.

The session's processes (the controller and its xdist workers, which
inherit its environment) share one cache: what one worker compiled for a
model the others find. Every entry is written whole and renamed into place
(``frontends.cache_dir.write_entry``, ``Artifact.write``), so workers filling
it at once cannot read a half-written one; a test that needs an empty cache
makes its own (``private_cache`` fixtures).

Each xdist worker runs on cores of its own (``_own_cores``)."""
from __future__ import annotations

import atexit
import ctypes
import gc
import os
import shutil
import sys
import tempfile

import pytest

#: what one worker can hold at its peak (real models, a server beside the
#: test, llama.cpp's): more workers than memory allows would swap or be killed
WORKER_BYTES = 8 << 30

#: set by the process that made the session's cache, for the workers it starts
SESSION_CACHE = "LMC_TEST_SESSION_CACHE"

if os.environ.get(SESSION_CACHE) and os.path.isdir(os.environ[SESSION_CACHE]):
    os.environ["LMC_CACHE_DIR"] = os.environ[SESSION_CACHE]     # a worker: its controller's cache
else:
    _cache = tempfile.mkdtemp(prefix="lmc-test-cache-")
    os.environ["LMC_CACHE_DIR"] = os.environ[SESSION_CACHE] = _cache
    # a session compiles a few GB into it: left behind, 600 of them filled a 250 GB disk
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)


def pytest_xdist_auto_num_workers(config) -> int:
    """One worker per core the process may use, as far as memory holds
    WORKER_BYTES for each."""
    from compiler.host_cores import usable_cores

    cores = usable_cores()
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 1
    return max(1, min(cores, mem // WORKER_BYTES))


def _own_cores() -> None:
    """Give this xdist worker (and the processes it starts) its share of the
    cores. A model's threads wait for each other at every op (lmc's barrier,
    llama.cpp's); with two workers' threads on the same two cores each wait
    could last a scheduler slice: on 2 cores (test_families, _batch,
    _speculative, _memory, _context_shift: 193 tests, an empty cache) 338 s
    with two workers sharing the cores, 299 s in one process, 287 s with a
    core each. ``whole_machine`` gives a test module all of them back."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if count < 2 or not worker.startswith("gw") or not hasattr(os, "sched_setaffinity"):
        return
    cores = _ALL_CORES
    if len(cores) < count:
        return
    i = int(worker[2:]) % count
    os.sched_setaffinity(0, cores[i * len(cores) // count:(i + 1) * len(cores) // count])


#: the cores the session may use, before a worker takes its share
_ALL_CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
_own_cores()


@pytest.fixture(scope="module")
def whole_machine():
    """Every core for a module's tests (a Ray cluster's many processes and
    its timed scaling), the worker's own share again after it."""
    if not _ALL_CORES:
        yield
        return
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, _ALL_CORES)
    try:
        yield
    finally:
        os.sched_setaffinity(0, mine)


def _rss_mb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20


#: module globals in which test modules keep what they compiled for their own tests (kernels by
#: signature, tokenizers by file): emptied when the module ends
MODULE_CACHES = ("_KERNELS", "_CACHE")


def _release_memory() -> None:
    """Collect cycles, then give the C heap's free pages back (glibc): compiling a kernel
    leaves ~10 MB of freed but held heap behind it."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


@pytest.fixture(autouse=True, scope="module")
def _release_after_module(request):
    """What a module held for its own tests goes when it ends: its kernel caches
    (``MODULE_CACHES``), whatever its models, executors and servers left in reference
    cycles, and the heap they used. Without it a worker kept every kernel the session
    compiled (test_bits_on_every_cpu alone: +4.5 GB) and was OOM-killed at 11.0 GB.
    LMC_TEST_RSS_LOG=FILE appends each module's resident MB before and after, per worker."""
    yield
    log = os.environ.get("LMC_TEST_RSS_LOG")
    before = _rss_mb() if log else 0
    # the module's own, and the helper the layout test files share
    for mod in (request.module, sys.modules.get("kernel_checks")):
        for name in MODULE_CACHES:
            cache = getattr(mod, name, None)
            if isinstance(cache, dict):
                cache.clear()
    _release_memory()
    if log:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(log, "a") as f:
            f.write(f"{worker} {request.module.__name__} {before} {_rss_mb()}\n")
