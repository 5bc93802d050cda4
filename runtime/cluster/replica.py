"""One engine replica of ``lmc serve --replicas``: a whole lmc engine (the
model compiled for batched serving, its paged KV pool and engine thread,
built exactly as the single-process server builds it) behind a Ray Serve
deployment. ``deployment`` wraps this class; it holds no Ray state itself.

``generate`` takes an engine ``Request`` (its ``emit`` and grammar matcher
left out: they cannot cross processes; the constraint comes beside it and
the replica builds its own matcher) and yields ``Accepted`` or a
``Refused``, then the request's events until its finish. A caller that goes
away cancels the request here, which frees its KV blocks.

``record_routing_stats`` is what the router sees of this replica: the
hashes of the blocks its pool holds, its load and its metrics (Serve pulls
it every ``STATS_PERIOD_S``); ``check_health`` fails once the engine thread
has died, and Serve replaces the replica.
"""
from __future__ import annotations

import asyncio
import os
import socket
from dataclasses import dataclass
from typing import Any, AsyncIterator

from ..engine import EngineBusy, EngineError, Event, Request
from ..grammar import Constraint, ConstraintError, GrammarMatcher
from ..serve.backend import ModelInfo
from ..serve.server import ServerOptions, build_serving

@dataclass
class Accepted:
    """The first item of a request's stream when a replica took it: which replica."""

    replica: str


@dataclass
class Refused:
    """A request the replica would not take: ``busy`` (EngineBusy) or ``invalid`` (EngineError)."""

    why: str
    message: str
    replica: str = ""


class EngineReplica:
    def __init__(self, opts: ServerOptions) -> None:
        self.serving = build_serving(opts)
        self.engine = self.serving.engine
        self.backend = self.serving.backend
        self.engine.start()
        self.name = os.environ.get("LMC_REPLICA_NAME") or str(os.getpid())
        try:
            from ray import serve

            self.name = serve.get_replica_context().replica_id.unique_id
        except Exception:   # outside a Serve replica (tests build one directly)
            pass

    def info(self) -> ModelInfo:
        """The served model, as this replica built it."""
        return self.backend.info

    async def generate(self, req: Request, constraint: Constraint | None = None) -> AsyncIterator[Any]:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        req.emit = lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev)
        info = self.backend.info
        try:
            if constraint is not None:
                req.grammar = GrammarMatcher(constraint, self.backend.tokenizer, info.stop_ids, info.vocab)
            self.engine.submit(req)
        except EngineBusy as e:
            yield Refused("busy", str(e), self.name)
            return
        except (EngineError, ConstraintError, ValueError) as e:
            yield Refused("invalid", str(e), self.name)
            return
        yield Accepted(self.name)
        done = False
        try:
            while not done:
                ev: Event = await events.get()
                done = ev.finish_reason is not None
                yield ev
        finally:
            if not done:   # the caller went away (or the stream was cancelled): free its blocks
                self.engine.cancel(req.id)

    def record_routing_stats(self) -> dict[str, Any]:
        return {"blocks": list(self.engine.cached_hashes), "outstanding": self.engine.outstanding,
                "replica": self.name, "pid": os.getpid(), "host": socket.gethostname(), "metrics": self.backend.metrics_text().decode()}

    def check_health(self) -> None:
        if not self.engine.alive:
            raise RuntimeError("the engine thread has stopped")

    def drain(self, grace_s: float) -> None:
        self.engine.drain(grace_s)

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.stop()
