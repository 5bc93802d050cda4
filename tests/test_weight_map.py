"""The model file's mapping on 2 MiB pages (runtime.weight_map): a file
just written, or not cached at all, ends up cached in large folios and
mapped with PMD entries, with the file's bytes unchanged."""
from __future__ import annotations

import mmap
import os
import shutil

import numpy as np
import pytest

from runtime.weight_map import MIN_SHARE, SAMPLE_BYTES, UNCACHED, file_huge_pages_seen, huge_share, map_weights

pytestmark = pytest.mark.skipif(not file_huge_pages_seen(),
                                reason="this kernel keeps no file pages on 2 MiB folios (FileHugePages is 0)")


def _write(path, n: int = 5 * SAMPLE_BYTES) -> np.ndarray:
    """A file as a download or a copy leaves it (shutil.copyfile: the page
    cache holds it in small folios; one big write() would not)."""
    data = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    src = f"{path}.src"
    with open(src, "wb") as f:
        f.write(data.tobytes())
    shutil.copyfile(src, path)
    os.unlink(src)
    return data


def _share(path) -> float | None:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        return huge_share(m)


def test_a_file_just_written_is_read_again_onto_large_folios(tmp_path):
    p = tmp_path / "weights.bin"
    data = _write(p)
    before = _share(p)
    assert before is not None and 0 <= before < MIN_SHARE, before   # the write path's small folios
    m = map_weights(str(p))
    assert np.array_equal(np.frombuffer(m, np.uint8), data)
    assert huge_share(m) >= MIN_SHARE
    m.close()


def test_an_uncached_file_is_read_front_to_back(tmp_path):
    p = tmp_path / "weights.bin"
    data = _write(p)
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    assert _share(p) == UNCACHED
    m = map_weights(str(p))
    assert huge_share(m) >= MIN_SHARE
    assert np.array_equal(np.frombuffer(m, np.uint8), data)
    m.close()


def test_switched_off_it_leaves_the_page_cache_alone(tmp_path, monkeypatch):
    p = tmp_path / "weights.bin"
    _write(p)
    monkeypatch.setenv("LMC_HUGE_PAGES", "0")
    m = map_weights(str(p))
    assert huge_share(m) < MIN_SHARE
    m.close()
