"""Test-session setup: a private compile cache, so tests never touch (or
depend on) the user's ~/.cache/lmc; and how many pytest-xdist workers
``-n auto`` starts."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile

#: what one worker can hold at its peak (real models, a server beside the
#: test, llama.cpp's): more workers than memory allows would swap or be killed
WORKER_BYTES = 8 << 30

_cache = tempfile.mkdtemp(prefix="lmc-test-cache-")
os.environ["LMC_CACHE_DIR"] = _cache
# each pytest process (the controller and every xdist worker) compiles about 1 GB into its own
# cache: left behind, 600 of them filled a 250 GB disk
atexit.register(shutil.rmtree, _cache, ignore_errors=True)


def pytest_xdist_auto_num_workers(config) -> int:
    """One worker per core the process may use, as far as memory holds
    WORKER_BYTES for each (each worker has its own compile cache above)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 1
    return max(1, min(cores, mem // WORKER_BYTES))
