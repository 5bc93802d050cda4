"""What the routes need of whatever serves the model: the small interface
that the single-process server (``EngineBackend``, over ``runtime.engine``)
implements, and that a deployment with replicas can implement too.

A backend takes a ``Request`` (``submit``: raises ``EngineError`` for one
that can never run, ``EngineBusy`` for one that cannot run now) and calls its
``emit`` with each ``Event``, from any thread; ``cancel`` drops a request
whose client went away. It says what model it serves (``ModelInfo``), holds
its tokenizer, and keeps the metrics ``/metrics`` shows.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Protocol

from ..engine import Engine, Request
from ..speculative import DEFAULT_DRAFT_MAX
from .metrics import ServerMetrics


@dataclass
class ModelInfo:
    """The served model, as /v1/models and the request defaults see it."""

    model_id: str
    ctx: int
    vocab: int
    meta: dict | None = None
    #: the model's end-of-generation tokens (a grammar's output ends with one)
    stop_ids: tuple[int, ...] = ()
    #: speculation for requests that do not say: prompt lookup's n-gram length
    #: (0: the backend's model drafter, if any), and tokens drafted per step at most
    lookup: int = 0
    draft_max: int = DEFAULT_DRAFT_MAX
    #: ``--context-shift``: requests go on past the context (``runtime.context_shift``)
    context_shift: bool = False
    created: int = field(default_factory=lambda: int(time.time()))


class ServingBackend(Protocol):
    info: ModelInfo
    #: encode, decode, chat_ids, token_to_piece
    tokenizer: Any

    def submit(self, req: Request) -> "None | Awaitable[None]":
        """Take ``req`` or raise EngineError / EngineBusy; a backend whose
        engines live elsewhere returns an awaitable that raises them."""

    def cancel(self, req_id: str) -> None: ...

    def metrics_text(self) -> bytes: ...

    def count_error(self, status: int) -> None:
        """A request refused with ``status`` (a 4xx, or 503)."""


@dataclass
class EngineBackend:
    """The engine of this process (``lmc serve``)."""

    engine: Engine
    tokenizer: Any
    info: ModelInfo
    metrics: ServerMetrics

    def submit(self, req: Request) -> None:
        self.engine.submit(req)

    def cancel(self, req_id: str) -> None:
        self.engine.cancel(req_id)

    def metrics_text(self) -> bytes:
        return self.metrics.text()

    def count_error(self, status: int) -> None:
        self.metrics.http_errors.labels(str(status)).inc()
