"""Where lmc keeps what it can recompute: ``$LMC_CACHE_DIR``, else
``$XDG_CACHE_HOME/lmc``, else ``~/.cache/lmc``. Frontends cache GGUF metadata
and QSF verification stamps there, the compiler its object code."""
from __future__ import annotations

import os
import threading


def cache_root() -> str:
    d = os.environ.get("LMC_CACHE_DIR")
    if d:
        return d
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "lmc")


def write_entry(path: str, data: bytes) -> bool:
    """Write a cache entry whole or not at all (a temporary file per process
    and thread, renamed over ``path``). Best effort: False when it could not
    be written, which only costs recomputing it next time."""
    tmp = f"{path}.{os.getpid()}.{threading.get_ident():x}.part"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        return True
    except OSError:
        try:
            os.remove(tmp)
        except OSError:
            pass
        return False
