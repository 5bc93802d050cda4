"""The model file mapped for compiled code, on 2 MiB pages where Linux can.

A decode step reads every weight once. On 4 KiB pages that is a page walk
every 4 KiB; Linux (6.x, on file systems with large folios: ext4, xfs)
maps a page-cache folio of 2 MiB with one PMD entry instead. Which folios
the page cache holds depends on how the file got there: a file just
written (a download, a copy) sits in small folios, one read through
readahead in large ones, and it stays that way while it is cached.
Measured on Qwen2.5-Coder-0.5B (2 threads): a decode step took 17.7 ms with
116 of 383 MB of the mapping on 2 MiB pages, 15.5 ms with 352 MB.

So ``map_weights`` maps the file and looks at a sample from its middle:
- not in the page cache: it reads the file front to back now (readahead
  caches it in large folios), rather than leave it to the first step,
  whose faults come from every thread in tensor order (small folios);
- cached, but mostly on small pages, while the kernel does keep file pages
  on 2 MiB folios (FileHugePages): it writes the file back, asks the
  kernel to drop its cached pages (``POSIX_FADV_DONTNEED`` drops only pages
  nobody has mapped), reads it front to back and maps it again. That costs
  one read of the file, once per time the file enters the page cache.
``LMC_HUGE_PAGES=0`` turns it off (for comparisons).
"""
from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np

from ir.switches import switch

_HUGE = 2 << 20
#: bytes faulted in to judge the mapping (16 huge pages)
SAMPLE_BYTES = 32 << 20
#: below this share of the sample on 2 MiB pages, the file is read again
MIN_SHARE = 0.5


def map_weights(path: str) -> mmap.mmap:
    """``path`` mapped read-only, its page cache on large folios if it can be."""
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if not switch("LMC_HUGE_PAGES") or len(m) < 4 * SAMPLE_BYTES:
            return m
        share = huge_share(m)
        try:
            if share == UNCACHED:        # to be read anyway: front to back, not as the first step faults it
                _read_through(f)
            elif share is not None and share < MIN_SHARE and file_huge_pages_seen():
                m.close()
                os.fsync(f.fileno())     # dirty pages (a file just written) are not dropped
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                _read_through(f)
                m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError:
            if m.closed:
                m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return m


def _read_through(f) -> None:
    """Read the file front to back, so readahead caches it in large folios
    (the first decode step's faults come from two threads in tensor order,
    which readahead takes for random access: small folios)."""
    buf = bytearray(8 << 20)
    f.seek(0)
    while f.readinto(buf):
        pass


#: ``huge_share`` of a file whose sample is not in the page cache
UNCACHED = -1.0


def huge_share(m: mmap.mmap) -> float | None:
    """Of a sample from the middle of ``m``, the share mapped on 2 MiB pages
    (``UNCACHED`` if the sample is not in the page cache; None where the
    kernel does not say: not Linux, an old kernel)."""
    start = (len(m) // 2) // _HUGE * _HUGE
    a = np.frombuffer(m, np.uint8)
    addr = a.ctypes.data
    cached = _cached(addr + start, SAMPLE_BYTES)
    if cached is None or not cached:
        return None if cached is None else UNCACHED
    int(a[start: start + SAMPLE_BYTES: 4096].sum())   # map the sample (no I/O: it is cached)
    del a
    fields = _smaps_of(addr)
    if not fields or "FilePmdMapped" not in fields or not fields.get("Rss"):
        return None
    return fields["FilePmdMapped"] / fields["Rss"]


def _cached(addr: int, length: int) -> bool | None:
    """Whether most of the page-aligned range is in the page cache
    (mincore(2)); None if that cannot be asked."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        vec = np.zeros(-(-length // mmap.PAGESIZE), np.uint8)
        if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(length), vec.ctypes.data) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return bool((vec & 1).mean() > 0.9)


def file_huge_pages_seen() -> bool:
    """Whether this kernel keeps any file pages on 2 MiB folios (FileHugePages
    in /proc/meminfo): where it never does, reading the file again would not
    help, and would cost a read at every start."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("FileHugePages:"):
                return int(line.split()[1]) > 0
    except (OSError, ValueError):
        pass
    return False


def _smaps_of(addr: int) -> dict[str, int] | None:
    """The kB fields of the mapping that starts at ``addr`` in /proc/self/smaps."""
    try:
        lines = open("/proc/self/smaps").read().splitlines()
    except OSError:
        return None
    found: dict[str, int] | None = None
    for line in lines:
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            if found is not None:
                return found
            lo = head.split("-")[0]
            try:
                found = {} if int(lo, 16) == addr else None
            except ValueError:
                found = None
        elif found is not None and line.endswith(" kB"):
            key, val = line.split(":", 1)
            found[key] = int(val.split()[0])
    return found
