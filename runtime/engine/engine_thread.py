"""The engine as ``lmc serve`` and the in-process tests use it: one thread
steps the core (``core.EngineCore``) while requests come and go from any
thread.

``submit`` and ``cancel`` go through an inbox the engine thread empties
before each step, so the core and the scheduler are only ever touched by
that thread. The queue is bounded (``EngineBusy`` beyond it); ``drain``
refuses new requests and cuts what is left after a grace period. Each
request hears its events through its ``emit`` callback, from the engine
thread; after each step the metrics (``runtime.serve.metrics``) record what
it counted and how loaded the engine is.
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque
from typing import Any

from ..speculative import Drafter
from .block_manager import BlockManager
from .core import EngineCore, StepOutput
from .requests import EngineBusy, Request
from .sequence import Sequence


class Engine:
    def __init__(self, model: Any, max_batch: int, prefill_chunk: int = 64, metrics: Any = None,
                 max_queue: int = 64, drafter: Drafter | None = None, context_shift: bool = False) -> None:
        """``model``: built for batched serving (``load_batch_model``);
        ``max_batch``: sequences advanced together; ``max_queue``: requests
        that may wait beyond them (more are refused with EngineBusy);
        ``drafter``: the draft model requests use unless they ask for prompt
        lookup (``runtime.speculative.build.build_drafter``), or None;
        ``context_shift``: sequences go on past the context (``EngineCore``)."""
        self.core = EngineCore(model.executor, model.tokenizer, model.config.stop_ids, model.config.vocab_size,
                               max_batch, prefill_chunk, drafter, context_shift)
        self.metrics = metrics
        self.max_queue = max(0, int(max_queue))
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._outstanding = 0            # submitted and not finished, counted under the lock
        self._lock = threading.Lock()
        self.draining = False
        self.drain_deadline = float("inf")
        #: the hashes of the full blocks the pool holds (``block_manager.prefix_hashes``), renewed
        #: by the engine thread after a step that cached or evicted one: what a replica publishes
        self.cached_hashes: tuple[bytes, ...] = ()
        self._hashes_version = 0
        if metrics:
            metrics.observe(self.core.current_load())   # the pool's size is known before the first step

    # --- what the core holds, for the server and the tests -------------------------------------
    @property
    def vocab(self) -> int:
        return self.core.vocab

    @property
    def ctx(self) -> int:
        return self.core.ctx

    @property
    def max_batch(self) -> int:
        return self.core.max_batch

    @property
    def blocks(self) -> BlockManager:
        return self.core.blocks

    @property
    def running(self) -> list[Sequence]:
        return self.core.scheduler.running

    @property
    def waiting(self) -> deque[Sequence]:
        return self.core.scheduler.waiting

    @property
    def steps(self) -> int:
        return self.core.steps

    # --- from any thread ---------------------------------------------------------------------
    def submit(self, req: Request) -> None:
        """Queue a request; raises EngineError (it can never run here) or
        EngineBusy (not now)."""
        self.core.check(req)
        with self._lock:
            if self.draining:
                raise EngineBusy("the server is shutting down")
            if self._outstanding >= self.core.max_batch + self.max_queue:
                raise EngineBusy(f"{self._outstanding} requests are running or queued, the most this server takes")
            self._outstanding += 1
        self._inbox.put(("add", req))
        self._wake.set()

    @property
    def outstanding(self) -> int:
        """Requests submitted and not yet finished."""
        return self._outstanding

    def drain(self, grace_s: float) -> None:
        """Take no new requests; what runs or waits finishes, and whatever is
        left after ``grace_s`` seconds is cut (finish reason ``length``)."""
        with self._lock:
            self.draining = True
            self.drain_deadline = time.monotonic() + max(0.0, grace_s)
        self._wake.set()

    def cancel(self, req_id: str) -> None:
        """Stop a request (its client went away); its blocks are freed."""
        self._inbox.put(("cancel", req_id))
        self._wake.set()

    @property
    def alive(self) -> bool:
        """The engine thread runs (a replica's health check)."""
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def start(self) -> "Engine":
        self._thread = threading.Thread(target=self._loop, name="lmc-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    # --- the engine thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            self._intake()
            if not self.core.has_work():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                self.step()
            except Exception as e:   # never leave clients hanging: fail what was running, keep serving
                self._deliver(self.core.end_all("error", f"the engine failed: {type(e).__name__}: {e}"))

    def _intake(self) -> None:
        while True:
            try:
                what, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if what == "add":
                self.core.add(arg)
                if self.metrics:
                    self.metrics.requests.inc()
            else:
                self.core.cancel(arg)

    def step(self) -> None:
        """One step (public for tests that drive the engine by hand): what
        came in, then the core's step, unless a drain's deadline has passed
        (then everything left is cut)."""
        self._intake()
        self._forget(len(self.core.drop_cancelled()))   # nobody listens any more
        if self.draining and time.monotonic() >= self.drain_deadline:
            self._deliver(self.core.end_all("length"))
            return
        out = StepOutput()
        try:
            self.core.step(out)
        finally:   # what the step decided reaches its requesters, even when it failed half-way
            self._deliver(out)
        if self.metrics:
            self.metrics.record(out.stats)
            self.metrics.observe(self.core.current_load())
        blocks = self.core.blocks
        if blocks.version != self._hashes_version:
            self._hashes_version, self.cached_hashes = blocks.version, tuple(blocks.cached)

    def _deliver(self, out: StepOutput) -> None:
        self._forget(len(out.finished))
        for req, ev in out.events:
            req.emit(ev)

    def _forget(self, n: int) -> None:
        if n:
            with self._lock:
                self._outstanding -= n
