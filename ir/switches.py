"""lmc's on/off environment switches (``LMC_AMX``, ``LMC_REPACK`` ...).

Each is 0 or 1, or unset for its default. Any other value is an error that
names the variable: read silently as the default, a typo (``LMC_AMX=off``)
would measure the path it meant to turn off. A ValueError, so the ``lmc``
command reports it in one line with exit code 2."""
from __future__ import annotations

import os

#: every switch, its default, and what it does (the README lists the same)
SWITCHES: dict[str, tuple[bool, str]] = {
    "LMC_AMX": (True, "AMX tiles where the CPU has them (0: the VNNI code)"),
    "LMC_REPACK": (True, "weights repacked into the kernels' tiles (0: as the file stores them)"),
    "LMC_REPACK_CACHE": (True, "repacked weights kept in the cache directory"),
    "LMC_KV_RING": (True, "sliding-window layers keep a ring of their window (0: a whole cache)"),
    "LMC_ATTN_TILED": (True, "prompt rows from position 512 attend on AMX bf16 tiles (0: decode's bits)"),
    "LMC_HUGE_PAGES": (True, "the weight image on large page-cache folios where it can be"),
    "LMC_KEY_OFFSETS": (True, "low-bit KV caches store keys against a calibrated offset row"),
    "LMC_KV_EXACT": (True, "low-bit KV caches keep each query's recent rows and position 0 exact (f16)"),
}


def switch(name: str) -> bool:
    """Whether switch ``name`` is on: its value, or its default when unset
    or empty; ValueError for anything but 0 and 1."""
    default = SWITCHES[name][0]
    value = os.environ.get(name, "").strip()
    if value == "":
        return default
    if value not in ("0", "1"):
        raise ValueError(f"{name}={value!r}: set it to 0 or 1 (or unset it: {int(default)}, "
                         f"{SWITCHES[name][1]})")
    return value == "1"


def check_switches() -> None:
    """Read every switch: a bad value is an error before any work, whatever
    path would have read it (``LMC_AMX=off`` on a CPU without AMX too)."""
    for name in SWITCHES:
        switch(name)
