"""Repacked weights kept between runs (``passes/repack``): the image bytes
of a model's repacked weights, one cache file per model file and repack plan.

Repacking reads the weights once and rewrites them (about a second for the
0.5 GB of Qwen2.5-Coder-0.5B). It is part of compiling: ``compile_native``
writes the entry on a thread while LLVM works, and a warm start maps it
read-only over its place in the weight image (``runtime.weight_image``),
as it maps the model file itself: page cache memory that the kernel may drop
and read again, shared between processes, on 2 MiB pages where the file
system gives large folios. The runtime repacks in place only when there is
no entry (the cache is off, an artifact came from elsewhere). The key
covers the model file's fingerprint, the plan's regions and the repacking
code itself, so a changed file, plan or byte format never maps stale bytes;
an entry's size and the digest of a sample of it are checked before it is
mapped (a truncated or overwritten entry is built again; a single flipped
bit between the samples is not caught, as in the model file itself).
``LMC_REPACK_CACHE=0`` turns the cache off.
"""
from __future__ import annotations

import json
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np

from frontends.cache_dir import cache_root, write_entry
from ir.quant import repacked_layout
from ir.switches import switch

from .artifact import sampled_digest
from .host_cores import usable_cores

#: rows of a large weight repacked per job (the threads share a 150 MB head)
ROW_BLOCK = 8192
_PAGE = mmap.PAGESIZE


def enabled() -> bool:
    return switch("LMC_REPACK_CACHE")


def _get(r: Any, name: str) -> Any:
    return r[name] if isinstance(r, dict) else getattr(r, name)


def repack_regions(regions: Sequence[Any]) -> list[Any]:
    """The regions (dicts of a manifest, or region records) with codec repack."""
    return [r for r in regions if _get(r, "codec") == "repack"]


def span(regions: Sequence[Any]) -> tuple[int, int]:
    """[lo, hi) of the image the repacked regions cover, lo on a page."""
    lo = min(_get(r, "image_offset") for r in regions) // _PAGE * _PAGE
    return lo, max(_get(r, "image_offset") + _get(r, "size") for r in regions)


def cache_key(model: dict[str, Any], regions: Sequence[Any]) -> str | None:
    """The key of a manifest's repacked regions (``model``: the manifest's
    model fingerprint); None when the cache is off or there are none."""
    from ir.digest import sha256
    import ir.quant.repack as packing
    import ir.quant.table as table

    rp = repack_regions(regions)
    if not enabled() or not rp:
        return None
    h = sha256()
    for mod in (packing, table):   # the tiles' code and the types' facts
        with open(mod.__file__, "rb") as f:
            h.update(f.read())
    code = h.hexdigest()
    rows = [{k: list(v) if isinstance(v, tuple) else v for k, v in
             ((n, _get(r, n)) for n in ("file_offset", "stored", "image_offset", "size", "layout", "shape",
                                        "repack"))}
            for r in rp]
    ident = {k: v for k, v in model.items() if k != "path"}
    what = json.dumps({"model": ident, "regions": rows, "code": code}, sort_keys=True)
    return sha256(what.encode()).hexdigest()[:32]


def entry_path(key: str) -> str:
    return os.path.join(cache_root(), "repacked", f"{key}.bin")


def lookup(key: str, size: int) -> str | None:
    """The entry of ``key`` if it is there whole: ``size`` bytes, and the
    digest of a sample of it (``compiler.artifact.sampled_digest``) the one
    written beside it. A damaged entry is deleted (the caller repacks)."""
    path = entry_path(key)
    try:
        with open(path + ".sha256", encoding="ascii") as f:
            want = f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None                      # none, or not sealed yet (a compile beside us is writing it)
    try:
        if os.path.getsize(path) == size and want == _digest(path):
            return path
    except OSError:
        pass
    for p in (path, path + ".sha256"):
        try:
            os.remove(p)
        except OSError:
            pass
    return None


#: digests this process computed when it sealed an entry, by path, with the (size, mtime) they
#: hold for: the runtime that maps an entry right after its compile wrote it (a cold start)
#: need not read the sample again
_SEALED: dict[str, tuple[tuple[int, int], str]] = {}


def _stamp(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def _digest(path: str) -> str:
    known = _SEALED.get(path)
    if known is not None and known[0] == _stamp(path):
        return known[1]
    return sampled_digest(path)


def _seal(path: str) -> None:
    """Write the digest that ``lookup`` checks beside a finished entry."""
    digest = sampled_digest(path)
    _SEALED[path] = (_stamp(path), digest)
    write_entry(path + ".sha256", digest.encode("ascii"))


def _jobs(regions: Sequence[Any]) -> list[tuple[Any, int, int]]:
    """(region, first row, rows): the regions in row blocks of whole tiles, largest first."""
    jobs = []
    for r in sorted(regions, key=lambda r: -_get(r, "size")):
        n = int(_get(r, "shape")[0])
        jobs += [(r, a, min(ROW_BLOCK, n - a)) for a in range(0, n, ROW_BLOCK)]
    return jobs


def _rows(r: Any, row0: int, rows: int) -> tuple[int, int, int, int]:
    """Source offset and length in the file, destination offset (image) and length of a row block."""
    n = int(_get(r, "shape")[0])
    sr, dr = _get(r, "stored") // n, _get(r, "size") // n     # bytes per row: whole tiles are contiguous in both
    return _get(r, "file_offset") + row0 * sr, rows * sr, _get(r, "image_offset") + row0 * dr, rows * dr


def _in_threads(fn, jobs: list) -> None:
    with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), usable_cores()))) as pool:
        for f in [pool.submit(fn, *job) for job in jobs]:
            f.result()


def repack_into(src: np.ndarray, dst: np.ndarray, regions: Sequence[Any], lo: int) -> None:
    """Repack each region from the file's bytes ``src`` into ``dst``, which
    holds image bytes [lo, lo + len(dst)), in row blocks on a thread per
    core (numpy's copies release the GIL)."""
    def run(r: Any, row0: int, rows: int) -> None:
        s0, sn, d0, dn = _rows(r, row0, rows)
        repacked_layout(_get(r, "layout"), _get(r, "repack")).repack(src[s0:s0 + sn], rows, int(_get(r, "shape")[1]),
                                             out=dst[d0 - lo:d0 - lo + dn])

    _in_threads(run, _jobs(regions))


def store(key: str, data: np.ndarray) -> bool:
    """Keep ``data`` as the entry of ``key`` (whole or not at all; best effort)."""
    path = entry_path(key)
    if not write_entry(path, memoryview(np.ascontiguousarray(data))):
        return False
    _seal(path)
    return True


def prepare(model_path: str, key: str | None, regions: Sequence[Any]) -> None:
    """Make sure the entry of ``key`` exists (the compiler's part), written
    by ``write_file``. Best effort: a failure leaves the runtime to repack
    at load."""
    rp = repack_regions(regions)
    if key is None or not rp:
        return
    lo, hi = span(rp)
    path = entry_path(key)
    if lookup(key, hi - lo):
        return
    tmp = f"{path}.{os.getpid()}.{threading.get_ident():x}.part"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "wb") as dst:
            write_file(model_path, dst.fileno(), rp)
        os.replace(tmp, path)
        _seal(path)
    except (OSError, ValueError):
        try:
            os.remove(tmp)
        except OSError:
            pass


def write_file(model_path: str, fd: int, regions: Sequence[Any]) -> None:
    """Write the repacked bytes of ``regions`` (image bytes [lo, hi) of
    ``span``) to the open file ``fd``: each row block read from the model
    file, repacked and written at its place, so the process holds a few
    blocks at a time, not the model (a compile, or a run under a memory
    budget whose streamed weights are read from this file)."""
    rp = repack_regions(regions)
    lo, hi = span(rp)
    os.ftruncate(fd, hi - lo)            # the gaps between regions read as zeros
    # each thread reads and repacks into two buffers of its own, kept from block to block:
    # new arrays per block cost a page fault per 4 KB (a tenth of a second for Qwen2.5-Coder)
    mine = threading.local()

    def buffers(sn: int, dn: int) -> tuple[np.ndarray, np.ndarray]:
        have = getattr(mine, "buffers", None)
        if have is None or have[0].size < sn or have[1].size < dn:
            have = mine.buffers = (np.empty(sn, np.uint8), np.empty(dn, np.uint8))
        return have[0][:sn], have[1][:dn]

    with open(model_path, "rb") as src:
        def run(r: Any, row0: int, rows: int) -> None:
            s0, sn, d0, dn = _rows(r, row0, rows)
            raw, out = buffers(sn, dn)
            if os.preadv(src.fileno(), [raw], s0) != sn:
                raise OSError(f"{model_path}: short read at byte {s0}")
            repacked_layout(_get(r, "layout"), _get(r, "repack")).repack(raw, rows, int(_get(r, "shape")[1]), out=out)
            if os.pwrite(fd, out, d0 - lo) != dn:
                raise OSError(f"short write of repacked weights at byte {d0 - lo}")

        _in_threads(run, _jobs(rp))
