"""Test-session setup: a private compile cache, so tests never touch (or
depend on) the user's ~/.cache/lmc; and how many pytest-xdist workers
``-n auto`` starts.

The session's processes (the controller and its xdist workers, which
inherit its environment) share one cache: what one worker compiled for a
model the others find. Every entry is written whole and renamed into place
(``frontends.cache_dir.write_entry``, ``Artifact.write``), so workers filling
it at once cannot read a half-written one; a test that needs an empty cache
makes its own (``private_cache`` fixtures)."""
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
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 1
    return max(1, min(cores, mem // WORKER_BYTES))


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
