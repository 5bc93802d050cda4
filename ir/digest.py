"""SHA digests without OpenSSL.

``hashlib`` loads libcrypto, about 3.7 MB resident, which a model run under
a tight ``--mem-budget`` cannot spare just to compute cache keys. Python's
built-in hash modules give the same digests (slower on large inputs, which
are hashed once and their results cached).
"""
from __future__ import annotations

try:
    from _sha256 import sha256   # CPython <= 3.11
except ImportError:   # pragma: no cover - newer CPython names the module _sha2
    try:
        from _sha2 import sha256
    except ImportError:
        from hashlib import sha256
try:
    from _sha1 import sha1
except ImportError:   # pragma: no cover
    from hashlib import sha1

__all__ = ["sha1", "sha256"]
