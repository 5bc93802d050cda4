"""The ingress's backend (``serve.backend.ServingBackend``) over engine
replicas on Ray Serve: the same routes, schemas, auth and errors as the
single-process server (``serve.app.create_app``) call it.

A request goes to ``EngineReplica.generate`` through the deployment handle
(so the router, ``router.CacheAffinityRouter``, picks its replica) as a
stream; ``submit`` returns once a replica has taken it or refused it (a
refusal is the same EngineBusy / EngineError the engine raises in one
process), and a task then hands its events to the request's ``emit``.

A replica that dies before the request's first event is tried once more
on another; after that the request ends with finish reason ``error`` and
a message the client sees, never a hang. ``cancel`` (the client went
away) cancels the stream, and the replica frees the request's blocks.
``drain``: new requests get 503; whatever still runs after the grace
period is cut (finish reason ``length``), as the engine's own drain does.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from ray.exceptions import RayError

from ..engine import EngineBusy, EngineError, Event, Request
from ..serve.backend import ModelInfo
from .metrics import IngressMetrics
from . import routing_state
from .replica import Accepted, Refused


class RayBackend:
    def __init__(self, handle: Any, tokenizer: Any, info: ModelInfo, metrics: IngressMetrics) -> None:
        self.stream = handle.options(stream=True)
        self.tokenizer = tokenizer
        self.info = info
        self.metrics = metrics
        self.draining = False
        self._tasks: dict[str, tuple[asyncio.Task, Request]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    # --- ServingBackend ----------------------------------------------------------------------------
    async def submit(self, req: Request) -> None:
        if self.draining:
            raise EngineBusy("the server is shutting down")
        self._loop = asyncio.get_running_loop()
        call = dataclasses.replace(req, emit=None, grammar=None)
        constraint = req.grammar.constraint if req.grammar is not None else None
        gen, replica = await self._open(call, constraint)
        task = self._loop.create_task(self._pump(req, call, constraint, gen, replica))
        self._tasks[req.id] = (task, req)

    def cancel(self, req_id: str) -> None:
        got = self._tasks.get(req_id)
        if got is not None:
            got[0].cancel()

    def metrics_text(self) -> bytes:
        return self.metrics.text()

    def count_error(self, status: int) -> None:
        self.metrics.http_errors.labels(str(status)).inc()

    # --- draining ----------------------------------------------------------------------------------
    def drain(self, grace_s: float) -> None:
        """Refuse new requests; cut what still runs after ``grace_s`` seconds (any thread)."""
        self.draining = True
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.call_later, max(0.0, grace_s), self._cut_all)

    def _cut_all(self) -> None:
        for task, req in list(self._tasks.values()):
            task.cancel()
            req.emit(Event(finish_reason="length"))

    # --- one request -------------------------------------------------------------------------------
    async def _open(self, call: Request, constraint: Any) -> tuple[Any, str]:
        """The request's stream once a replica took it, and which replica; a
        replica that dies first is tried once more (Serve routes the retry
        anew)."""
        last: Exception | None = None
        for _ in range(2):
            gen = self.stream.generate.remote(call, constraint)
            try:
                first = await gen.__anext__()
            except RayError as e:
                last = e
                continue
            except StopAsyncIteration:
                last = RuntimeError("the replica closed the stream")
                continue
            if isinstance(first, Refused):
                routing_state.ended(first.replica)
                if first.why == "busy":
                    raise EngineBusy(first.message)
                raise EngineError(first.message)
            if not isinstance(first, Accepted):
                raise RuntimeError(f"unexpected first item from a replica: {first!r}")
            return gen, first.replica
        raise EngineBusy(f"no replica could take the request ({type(last).__name__}: {last})")

    async def _pump(self, req: Request, call: Request, constraint: Any, gen: Any, replica: str) -> None:
        emitted = retried = False
        try:
            while True:
                try:
                    async for ev in gen:
                        emitted = True
                        req.emit(ev)
                        if ev.finish_reason is not None:
                            return
                    req.emit(Event(finish_reason="error", error="the replica ended the stream before its finish"))
                    return
                except RayError as e:
                    if emitted or retried:
                        self.metrics.failed.inc()
                        req.emit(Event(finish_reason="error", error=f"the replica serving this request failed "
                                                                    f"({type(e).__name__}); its reply is cut"))
                        return
                    retried = True   # nothing reached the client yet: once more, elsewhere
                    self.metrics.retried.inc()
                    routing_state.ended(replica)
                    try:
                        gen, replica = await self._open(call, constraint)
                    except (EngineBusy, EngineError) as e2:
                        req.emit(Event(finish_reason="error", error=f"the replica serving this request failed, "
                                                                    f"and its retry too: {e2}"))
                        return
        except asyncio.CancelledError:
            gen.cancel()
            raise
        finally:
            routing_state.ended(replica)   # the router's count of this replica's requests
            self._tasks.pop(req.id, None)
