"""Where lmc keeps what it can recompute: ``$LMC_CACHE_DIR``, else
``$XDG_CACHE_HOME/lmc``, else ``~/.cache/lmc``. Frontends cache GGUF metadata
and QSF verification stamps there, the compiler its object code."""
from __future__ import annotations

import os


def cache_root() -> str:
    d = os.environ.get("LMC_CACHE_DIR")
    if d:
        return d
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "lmc")
