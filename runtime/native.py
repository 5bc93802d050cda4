"""The native executor: runs an artifact's compiled steps.

Weights are memory-mapped from the model file (never copied); the arena, the
KV cache and per-thread scratch are allocated once. Worker threads start
once per executor and wait inside native code (``lmc_worker``), so a token
step from Python is one ctypes call (``lmc_run``), which releases the GIL.
"""
from __future__ import annotations

import ctypes
import math
import mmap
import os
import threading
import time
import weakref

import numpy as np

from compiler.artifact import Artifact
from compiler.codegen.jit import LoadedCode
from compiler.host_cores import usable_cores
from compiler.codegen.ctl import IO_ERR_DECOMPRESS, PROFILE_HEADER, Ctl, StreamSlots as S
from compiler.driver import FROM_POSITION, attention_tiles

from .paged import PagedBatch, PoolShape, single_stream_only
from .ring_reach import RingReach

_RUN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_WORKER = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64)
_STOP = _RUN


def _aligned(nbytes: int, align: int = 64) -> np.ndarray:
    """Zeroed memory; from 1 MiB on an anonymous mapping (page aligned), whose
    pages become resident only when touched, 4 KiB at a time. (numpy asks
    for transparent huge pages on large arrays: a KV cache touched a few rows
    per layer then costs 2 MiB per layer and tensor, ~70 MB for Gemma 3.
    Nor did they speed up a long decode's attention: Qwen2.5 after 3,500
    positions on Zen 4, lmc profile, attention 3.57-4.69 ms of the step with
    MADV_HUGEPAGE against 3.77-4.84 without, alternated.)"""
    if nbytes >= 1 << 20 and align <= mmap.PAGESIZE:
        buf = mmap.mmap(-1, nbytes)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            try:
                buf.madvise(mmap.MADV_NOHUGEPAGE)
            except OSError:
                pass
        return np.frombuffer(buf, np.uint8)
    raw = np.zeros(nbytes + align, np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off: off + nbytes]


#: code and buffers of executors whose workers did not stop in time: kept
#: alive for the life of the process, since a worker may still run them
_LEAKED: list = []


def _shutdown(stop, ctl: np.ndarray, threads: list[threading.Thread], keep: tuple, fds: list[int]) -> None:
    """Stop the workers (and the I/O thread) before the code and buffers they
    use are freed."""
    stop(ctl.ctypes.data)
    for t in threads:
        t.join(timeout=10)
    if any(t.is_alive() for t in threads):
        _LEAKED.append((ctl, threads, keep))
        return
    for fd in fds:
        os.close(fd)


class NativeExecutor(PagedBatch, RingReach):
    """Same interface as ``InterpExecutor``: prefill, decode, reset; or, for
    an artifact built for batched serving, batch and copy_block."""

    name = "llvm"

    def __init__(self, art: Artifact, model_path: str, threads: int | None = None,
                 state: np.ndarray | None = None, settle_later: bool = False) -> None:
        """``state``: run on another executor's KV cache (a self-speculative
        draft of the first layers: its state layout must be a prefix of
        that executor's, which the caller checks). ``settle_later``: a cold
        start's repacked weights are mapped at once and put on large pages
        by ``settle_weights`` (``WeightImage``)."""
        self._settle_later = settle_later
        m = art.manifest
        self.threads = max(1, int(threads or usable_cores()))
        self._offered: Artifact | None = None   # the whole artifact, when this one is its decode step alone
        self._rest = None                       # and the build that makes it (compiler.native.RestOfBuild)
        self._rest_start = None                 # its start, due after this executor's first step
        self.stream = (m.get("memory") or {}).get("stream")
        if os.path.getsize(model_path) != m["model"]["size"]:
            raise ValueError(f"{model_path}: size changed since it was compiled")
        self._model_path = model_path
        self._map, self._weights = self._map_weights(m)
        self.chunk = int(m["prefill_chunk"])
        self.ring_slack = m.get("ring_slack")
        self._buffers_for(m)
        if state is not None and state.nbytes < int(m["state_bytes"]):
            raise ValueError(f"a shared KV cache of {state.nbytes} bytes is smaller than {m['state_bytes']}")
        self.state = _aligned(max(64, int(m["state_bytes"]))) if state is None else state
        prof = m.get("profile")
        self._profile = np.zeros(int(prof["slots"]), np.int64) if prof else None
        self.vocab = int(m["config"]["vocab_size"])
        self.ctx = int(m["ctx"])
        if m.get("batch"):
            bm = m["batch"]
            self.pool = PoolShape(int(bm["block_size"]), int(bm["n_blocks"]), int(bm["max_blocks_per_seq"]),
                                  self.ctx, self.vocab, int(bm["max_rows"]), int(bm["max_batch"]),
                                  int(bm.get("window", 0)))
        self._fds: list[int] = []
        self._buffers: list[np.ndarray] = []
        self._bind(art)
        if self.stream:
            self._start_io(model_path)
        self._finalizer = self._finalize_with(self._threads)

    def _map_weights(self, m: dict) -> tuple:
        """The weights at one address: the model file mapped, or the weight
        image (the file plus repacked or decompressed layers)."""
        model_path = self._model_path
        if m.get("image"):   # compressed layers: the file plus the decompressed ones, at one address
            from compiler.repack_cache import cache_key

            from .weight_image import WeightImage, regions_of

            skip = frozenset((self.stream or {}).get("packed_image_offsets", []))
            key = cache_key(m["model"], m["image"].get("regions", []))
            image = WeightImage(model_path, regions_of(m["image"]), int(m["image"]["size"]), skip, key,
                                streamed_repacked=bool((self.stream or {}).get("reads_repacked")),
                                settle_later=self._settle_later)
            return image, image.array
        if self.stream:   # the streamed layers are read into buffers: the mapping holds the rest
            with open(model_path, "rb") as f:
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        else:
            from .weight_map import map_weights

            mapped = map_weights(model_path)
        return mapped, np.frombuffer(mapped, np.uint8)

    def _buffers_for(self, m: dict) -> None:
        """The arena, per-thread scratch and IO area ``m`` needs (kept when
        they are large enough: a step's outputs are views of the arena)."""
        if getattr(self, "arena", None) is None or self.arena.nbytes < int(m["arena_bytes"]):
            self.arena = _aligned(max(64, int(m["arena_bytes"])))
        stride = int(m["scratch_floats"]) * 4
        if getattr(self, "scratch", None) is None or self._stride < stride:
            self.scratch, self._stride = _aligned(stride * self.threads), stride
        io = max(64, int(m.get("io_bytes", 0)), 4 * self.chunk)
        if getattr(self, "io", None) is None or self.io.nbytes < io:
            # graph inputs at the offsets the manifest gives (the token ids at 0)
            self.io = _aligned(io)
            self._tokens = self.io[: 4 * self.chunk].view(np.int32)

    def _bind(self, art: Artifact) -> None:
        """Load ``art``'s code, give it a fresh control block over this
        executor's buffers and start its worker threads."""
        m = art.manifest
        self.manifest = m
        self.code = LoadedCode(art.obj, shared=True)   # a shared library: LLVM stays unloaded
        self._native_run = _RUN(self.code.address("lmc_run"))
        self._run = self._native_run
        self._worker = _WORKER(self.code.address("lmc_worker"))
        self._stop = _STOP(self.code.address("lmc_stop"))
        self.ctl = _aligned(Ctl.SLOTS * 8).view(np.int64)
        c = self.ctl
        c[Ctl.NTHREADS] = self.threads
        c[Ctl.WEIGHTS] = self._weights.ctypes.data
        c[Ctl.ARENA] = self.arena.ctypes.data
        c[Ctl.STATE] = self.state.ctypes.data
        c[Ctl.IO] = self.io.ctypes.data
        c[Ctl.SCRATCH] = self.scratch.ctypes.data
        c[Ctl.SCRATCH_STRIDE] = self._stride
        if self._profile is not None:
            c[Ctl.PROFILE] = self._profile.ctypes.data
        self._ctl_ptr = c.ctypes.data
        self.entries = m["entries"]
        self._threads: list[threading.Thread] = []
        for tid in range(1, self.threads):
            t = threading.Thread(target=self._worker, args=(self._ctl_ptr, tid), daemon=True,
                                 name=f"lmc-worker-{tid}")
            t.start()
            self._threads.append(t)

    def _finalize_with(self, threads: list[threading.Thread]) -> weakref.finalize:
        keep = (self.code, self._map, self._weights, self.arena, self.state, self.scratch, self.io,
                self._buffers)
        return weakref.finalize(self, _shutdown, self._stop, self.ctl, threads, keep, self._fds)

    # --- an early decode step, then the whole artifact --------------------------------
    def follow(self, rest) -> None:
        """This executor runs an artifact of the decode step alone while
        ``rest`` (``compiler.native.RestOfBuild``) builds the whole one:
        it takes that at the first step after it is done. Until then a
        prompt runs as decode steps, which compute its rows with the same
        bits as a prompt chunk up to ``compiler.driver.FROM_POSITION``
        (from there on a prompt's rows attend on tiles: it waits)."""
        self._rest = rest
        self._rest_start = rest.start   # called after the first step: see RestOfBuild.start
        rest.when_done(self.offer)

    def offer(self, art: Artifact) -> None:
        """Run ``art`` from the next step on (called from any thread)."""
        self._offered = art

    def _take_offer(self) -> None:
        art, self._offered = self._offered, None
        m, old = art.manifest, self.manifest
        differ = [k for k in ("state_bytes", "state_offsets", "ctx", "prefill_chunk", "ring_slack", "kv_type")
                  if m.get(k) != old.get(k)]
        if differ:
            raise RuntimeError(f"the whole artifact does not fit its decode step's KV cache ({', '.join(differ)})")
        timed = self._run is not self._native_run
        self._finalizer.detach()
        _shutdown(self._stop, self.ctl, self._threads, (self.code,), [])   # the old code's workers
        if m.get("image") != old.get("image"):
            self._map, self._weights = self._map_weights(m)
        self._buffers_for(m)
        self._bind(art)
        if timed:
            self.time_steps(self._times)
        self._finalizer = self._finalize_with(self._threads)
        self._rest = None

    def wait_for_build(self) -> None:
        """Wait until the whole artifact is built (and cached: the next
        load is warm); it is taken at the next step."""
        if self._rest is not None:
            self._rest.result()

    def settle_weights(self) -> None:
        """Between steps: the weights mapped with ``settle_later`` go on
        large pages now (a read of the repacked bytes), for this run's
        remaining steps and the next load."""
        settle = getattr(self._map, "settle", None)
        if settle is not None:
            settle()

    def stop_building(self) -> None:
        """Stop the build of the whole artifact (this one runs on)."""
        if self._rest is not None:
            self._rest.cancel()

    @property
    def building(self) -> bool:
        """Whether the whole artifact is still being built."""
        return self._rest is not None and not self._rest.done() or self._offered is not None

    # --- layer streaming ------------------------------------------------------------
    def _start_io(self, model_path: str) -> None:
        """Two stream buffers, the model file open for pread, and the I/O
        thread (``lmc_io``, native: it never takes the GIL)."""
        c = self.ctl
        if self.stream.get("io", "pread") == "pread":  # mmap mode reads in place from self._map
            n = int(self.stream["buffer_bytes"])
            self._buffers = [_aligned(max(64, n)) for _ in range(2)]
            c[S.BUF0], c[S.BUF1] = (b.ctypes.data for b in self._buffers)
            staging = int(self.stream.get("staging_bytes", 0))
            if staging:   # compressed layers: read here, decompressed into the buffers by lmc_io
                from frontends.qsf_codecs import native_decompressor

                self._buffers.append(_aligned(staging))
                c[S.STAGE] = self._buffers[-1].ctypes.data
                c[S.LZ4_FN] = native_decompressor("lz4")
                try:
                    c[S.ZSTD_FN] = native_decompressor("zstd")
                except ValueError:
                    if any(r.get("codec") == "zstd" for r in (self.manifest.get("image") or {}).get("regions", [])):
                        raise
        fd = os.open(model_path, os.O_RDONLY)
        self._fds.append(fd)
        c[S.FD] = fd
        c[S.FD_REPACKED] = getattr(self._map, "repacked_fd", -1)   # owned by the weight image
        io = _RUN(self.code.address("lmc_io"))
        t = threading.Thread(target=io, args=(self._ctl_ptr,), daemon=True, name="lmc-io")
        t.start()
        self._threads.append(t)
        self._io = io

    def stream_stats(self) -> dict:
        """Time the compute side waited for reads, time and bytes the reader
        spent in pread, since the executor started (zeros without streaming)."""
        c = self.ctl
        return {"io_wait_s": float(c[S.WAIT_NS]) / 1e9, "read_s": float(c[S.READ_NS]) / 1e9,
                "read_bytes": int(c[S.READ_BYTES]), "reader_idle_s": float(c[S.IO_IDLE_NS]) / 1e9}

    def close(self) -> None:
        self.stop_building()
        self._finalizer()

    # --- profiling builds ------------------------------------------------------
    def profile_times(self, entry: str) -> tuple[int, int, int, np.ndarray]:
        """Profiling builds, summed over the steps of ``entry`` since the last
        ``reset_profile``: steps run, ns from ``lmc_run``'s start until every
        thread is in the step (waking the workers), ns from the last op until
        every thread is done, and ns per node."""
        if self._profile is None:
            raise ValueError("this artifact was not built for profiling (NativeOptions(profile=True))")
        r = self.manifest["profile"]["entries"][entry]
        base, n = int(r["base"]), int(r["nodes"])
        p = self._profile
        return (int(p[base + 1]), int(p[base + 2]), int(p[base + 3]),
                p[base + PROFILE_HEADER: base + PROFILE_HEADER + n].copy())

    def reset_profile(self) -> None:
        if self._profile is not None:
            self._profile[:] = 0

    def time_steps(self, times: list[float] | None = None) -> list[float]:
        """From now on, append the wall time (s) of each native step, the
        ``lmc_run`` call alone, to the returned list."""
        times = [] if times is None else times
        self._times = times
        run = self._native_run

        def timed(ctl: int) -> None:
            t0 = time.perf_counter()
            run(ctl)
            times.append(time.perf_counter() - t0)

        self._run = timed
        return times

    def reset(self) -> None:
        """Nothing to clear: attention only reads cache rows below the position."""
        self.forget_writes()

    def _step(self, entry: str, pos: int, T: int) -> np.ndarray:
        if self._offered is not None:
            self._take_offer()
        e = self.entries[entry]
        c = self.ctl
        c[Ctl.ENTRY] = e["index"]
        c[Ctl.POS] = pos
        c[Ctl.T] = T
        self._run(self._ctl_ptr)
        if self._rest_start is not None:   # once: the first step of a decode-first start
            start, self._rest_start = self._rest_start, None
            start()
        if self.stream and c[S.IO_ERROR]:
            what = "a compressed layer did not decompress" if c[S.IO_ERROR] == IO_ERR_DECOMPRESS \
                else "reading streamed weights failed"
            raise OSError(f"{self.manifest['model']['path']}: {what} (the file changed or was truncated?)")
        shape = [T if isinstance(d, str) else d for d in e["output_shape"]]
        n = math.prod(shape)   # (np.prod on a short list: microseconds a step, ~1% of the engine thread)
        return self.arena[e["output_offset"]: e["output_offset"] + 4 * n].view(np.float32).reshape(shape)

    def _check(self, ids, pos: int) -> None:
        # native code trusts ids and positions: check them here, cheaply
        if pos < 0 or pos + len(ids) > self.ctx:
            raise IndexError(f"positions {pos}..{pos + len(ids)} outside the context of {self.ctx}")
        if min(ids) < 0 or max(ids) >= self.vocab:
            raise IndexError(f"token id outside the vocabulary (0..{self.vocab - 1})")

    def decode(self, token: int, pos: int) -> np.ndarray:
        if "decode" not in self.entries:
            raise single_stream_only("decode")
        if not (0 <= token < self.vocab and 0 <= pos < self.ctx):
            self._check([token], pos)
        self._tokens[0] = token
        self.wrote(pos + 1)
        return self._step("decode", pos, 1)

    def prefill(self, ids: list[int], pos: int, all_logits: bool = False) -> np.ndarray:
        if self._offered is not None:
            self._take_offer()
        if "prefill" not in self.entries and self._rest is not None:
            return self._prefill_by_steps(ids, pos, all_logits)
        if "prefill" not in self.entries:
            raise single_stream_only("prefill")
        self._check(ids, pos)
        self.wrote(pos + len(ids))
        rows = []
        out = None
        for start in range(0, len(ids), self.chunk):
            part = ids[start: start + self.chunk]
            self._tokens[: len(part)] = part
            out = self._step("prefill_all" if all_logits else "prefill", pos + start, len(part))
            if all_logits:
                rows.append(out.copy())
        return np.concatenate(rows) if all_logits else out

    def _prefill_by_steps(self, ids: list[int], pos: int, all_logits: bool) -> np.ndarray:
        """A prompt as decode steps, while the prompt chunk's kernels are
        still compiling; the rest as chunks once they are there."""
        self._check(ids, pos)
        rows = []
        for i, tok in enumerate(ids):
            if pos + i >= FROM_POSITION and self._offered is None and attention_tiles():
                self.wait_for_build()   # a prompt chunk's row from here on attends on the tiles: not a step's bits
            if self._offered is not None:
                self._take_offer()
            if "prefill" in self.entries:
                rest = self.prefill(ids[i:], pos + i, all_logits)
                return np.concatenate([*rows, rest]) if all_logits else rest
            out = self.decode(tok, pos + i)
            if all_logits:
                rows.append(out.copy()[None])
        return np.concatenate(rows) if all_logits else out

    def verify(self, ids: list[int], pos: int) -> np.ndarray:
        """Logits after each of ``ids`` (at most a prefill chunk) at positions
        pos.., every row computed as ``decode`` computes it: speculative
        decoding checks drafted tokens with it. Without a ``verify`` entry
        (an artifact compiled without ``NativeOptions.verify``), decode
        steps one by one: the same numbers, without the speed."""
        if len(ids) > self.chunk:
            raise ValueError(f"verify takes at most {self.chunk} tokens, got {len(ids)}")
        if "verify" not in self.entries:
            return np.stack([self.decode(t, pos + i).copy() for i, t in enumerate(ids)])
        self._check(ids, pos)
        self.wrote(pos + len(ids))
        self._tokens[: len(ids)] = ids
        return self._step("verify", pos, len(ids))

    # --- batched serving (runtime.paged checked the inputs) ---------------------------
    def _entry_names(self):
        return self.entries

    def _batch_step(self, tokens: np.ndarray, positions: np.ndarray, tables: np.ndarray,
                    last_only: bool, decode: bool = False, rows: np.ndarray | None = None) -> np.ndarray:
        name = "batch_last" if last_only else "batch_decode" if decode and "batch_decode" in self.entries else \
            "batch_sel" if rows is not None else "batch"
        at = self.entries[name]["inputs"]
        feeds = (("tokens", tokens), ("positions", positions), ("block_tables", tables))
        if rows is not None:
            feeds += (("rows", rows),)
        for key, a in feeds:
            raw = np.ascontiguousarray(a, np.int32).view(np.uint8).reshape(-1)
            self.io[at[key]: at[key] + raw.size] = raw
        return self._step(name, 0, len(tokens))

    def _copy_block_rows(self, src: int, dst: int) -> None:
        offsets = self.manifest["state_offsets"]
        for name, n in self.manifest["batch"]["block_bytes"].items():
            base = int(offsets[name])
            self.state[base + dst * n: base + (dst + 1) * n] = self.state[base + src * n: base + (src + 1) * n]
