"""Test-session setup: a private compile cache, so tests never touch (or
depend on) the user's ~/.cache/lmc."""
from __future__ import annotations

import os
import tempfile

_cache = tempfile.mkdtemp(prefix="lmc-test-cache-")
os.environ["LMC_CACHE_DIR"] = _cache
