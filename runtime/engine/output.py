"""The output stage: sampled tokens in, what each requester hears out.

Per sequence it turns tokens into text as they come (incremental
detokenization: a character split over tokens waits for its last byte),
holds back whatever could still become a stop string, adds the
log-probabilities asked for, and decides where a sequence ends: an
end-of-generation token (unless ``ignore_eos``), a stop string, max_tokens
or the context. Of several tokens a step gives one sequence (accepted drafts
and the next), only those up to its end are kept.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence as Seq

import numpy as np

from ..stop_strings import TextAssembler
from .requests import Event, TokenLogprob
from .sequence import Sequence


@dataclass
class Emitted:
    """What the output stage made of one sequence's new tokens."""

    #: how many of the tokens it kept (up to and including a finishing one)
    kept: int
    #: an event per kept token
    events: list[Event]
    #: stop or length, None while the sequence goes on
    finish: str | None


class OutputProcessor:
    def __init__(self, tokenizer: Any, stop_ids: Seq[int], ctx: int, context_shift: bool = False) -> None:
        self.tokenizer = tokenizer
        self.stop_ids = frozenset(stop_ids)
        self.ctx = ctx
        #: the context does not end a sequence: the scheduler shifts it
        self.context_shift = context_shift
        self._text: dict[int, TextAssembler] = {}

    def add(self, s: Sequence) -> None:
        """A new sequence: its text starts after its prompt's last token."""
        self._text[s.key] = TextAssembler(self.tokenizer, s.tokens[-1], s.req.stop)

    def drop(self, s: Sequence) -> None:
        self._text.pop(s.key, None)

    def process(self, s: Sequence, tokens: list[int], logits: list[np.ndarray]) -> Emitted:
        """Events for ``tokens`` (chosen from the ``logits`` rows), sampled
        for ``s`` after its tokens so far; the last event of a finishing
        sequence carries the finish reason and the usage."""
        text = self._text[s.key]
        stop_ids = frozenset() if s.req.ignore_eos else self.stop_ids
        events: list[Event] = []
        for i, tok in enumerate(tokens):
            ev = Event(token_ids=[tok])
            if s.req.logprobs is not None:
                ev.logprobs = [token_logprob(logits[i], tok, s.req.logprobs)]
            finish = None
            if tok in stop_ids:
                finish = "stop"
            else:
                ev.text, stopped = text.feed(tok)
                if stopped:
                    finish = "stop"
            grammar = s.sampler.grammar
            if finish is None and grammar is not None and grammar.done_at == s.generated + i + 1:
                finish = "stop"   # the grammar is complete: nothing can follow
            generated, length = s.generated + i + 1, len(s.tokens) + i + 1
            full = length >= self.ctx and not self.context_shift
            if finish is None and (generated >= s.req.max_tokens or full):
                finish = "length"
            events.append(ev)
            if finish is not None:
                if not text.stopped:   # the end: what was held back (a partial character, a stop string's start) shows
                    ev.text += text.finish()[0]
                ev.finish_reason = finish
                ev.usage = usage(s, generated)
                self.drop(s)
                return Emitted(i + 1, events, finish)
        return Emitted(len(tokens), events, None)

    def ended(self, s: Sequence, reason: str, error: str | None = None, param: str | None = None) -> Event:
        """The last event of a sequence ended from outside its tokens (a
        drain's deadline, no room in the pool, an engine failure, a grammar
        its parser could not follow: ``param`` names the request's field);
        what its text held back stays unsaid."""
        self.drop(s)
        return Event(finish_reason=reason, error=error, usage=usage(s, s.generated), error_param=param)


def usage(s: Sequence, generated: int) -> dict[str, int]:
    """OpenAI's counts; with the engine's context shift also the shifts of
    the sequence and the tokens they dropped (``context_shifts``, ``shifted_tokens``); a prompt a shift
    cut to fit counts as it came."""
    n_prompt = s.n_prompt + s.req.shifted_prompt
    u = {"prompt_tokens": n_prompt, "completion_tokens": generated,
         "total_tokens": n_prompt + generated, "cached_tokens": s.cached_prompt}
    if s.context_shifts is not None:
        u.update(context_shifts=s.context_shifts, shifted_tokens=s.shifted_tokens)
    return u


def token_logprob(logits: np.ndarray, tok: int, k: int) -> TokenLogprob:
    """The chosen token's log-probability and the k most likely, from the
    model's raw distribution (before penalties and temperature, as llama.cpp
    and OpenAI report them)."""
    x = np.asarray(logits, np.float64)
    m = x.max()
    lse = m + np.log(np.exp(x - m).sum())
    top: list[tuple[int, float]] = []
    if k > 0:
        ids = np.argpartition(-x, min(k, x.size - 1))[:k]
        ids = ids[np.argsort(-x[ids], kind="stable")]
        top = [(int(i), float(x[i] - lse)) for i in ids]
    return TokenLogprob(int(tok), float(x[tok] - lse), top)
