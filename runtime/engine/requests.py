"""What a requester hands the engine (``Request``) and hears back (``Event``),
and the engine's two refusals."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..sampling import SamplerConfig


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]     # the most likely ids and their log-probabilities


@dataclass
class Event:
    """What a request hears: text (and the ids and log-probabilities behind
    it) as it is generated, then once a finish reason and the usage."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None     # stop, length, or error
    usage: dict[str, int] | None = None
    error: str | None = None
    #: the request field an error is about (a grammar its parser could not follow to the end: the
    #: request's fault, a 400 naming it); None: the server failed (a 500)
    error_param: str | None = None


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplerConfig
    emit: Callable[[Event], None]
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None      # None: off; k: the chosen token's and the k most likely
    id: str = ""
    ignore_eos: bool = False         # run to max_tokens (benchmarks; llama.cpp's and vLLM's field)
    lookup: int = 0                  # prompt lookup: n-gram length of the drafts (0: the engine's drafter, if any)
    draft_max: int = 8               # tokens drafted per step at most (0: no speculation)
    grammar: Any = None              # its own ``runtime.grammar.GrammarMatcher``: the output follows it
    keep: int = 0                    # with the engine's context shift: tokens at the start every shift keeps
    shifted_prompt: int = 0          # tokens a context shift dropped from the prompt before it ran


class EngineError(ValueError):
    """A request the engine cannot take (too long for the context ...)."""


class EngineBusy(Exception):
    """The queue is full, or the engine is draining: try again later."""
