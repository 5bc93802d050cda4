"""Stop strings over streamed text.

Generation is token by token, but a stop string is text: it can start in the
middle of one token and end in another. Streamed text must never show part
of a stop string, so whatever could still become one is held back until the
next piece decides it (OpenAI's and llama.cpp's servers behave the same way).
"""
from __future__ import annotations

from typing import Sequence

#: more stop strings than this, or longer ones, are a bad request (bounded work per token)
MAX_STOPS = 16
MAX_STOP_CHARS = 1024


class StopStringError(ValueError):
    """Stop strings that cannot be used (empty, too many, too long)."""


def check_stops(stops: Sequence[str] | str | None) -> list[str]:
    """The stop strings as a list, validated (a single string is one stop)."""
    if stops is None:
        return []
    if isinstance(stops, str):
        stops = [stops]
    out = list(stops)
    if len(out) > MAX_STOPS:
        raise StopStringError(f"stop: at most {MAX_STOPS} stop strings, got {len(out)}")
    for s in out:
        if not isinstance(s, str) or not s:
            raise StopStringError(f"stop: every stop string must be non-empty text, got {s!r}")
        if len(s) > MAX_STOP_CHARS:
            raise StopStringError(f"stop: a stop string of {len(s)} characters (at most {MAX_STOP_CHARS})")
    return out


class StopMatcher:
    """Feed text as it is generated; get back what may be shown.

    ``feed`` returns (text safe to show, stopped). Once a stop string is
    complete, the text before its first occurrence is returned and the
    matcher is stopped; the stop string itself is never shown. ``flush``
    returns what was held back when generation ends without a stop."""

    def __init__(self, stops: Sequence[str] | str | None) -> None:
        self.stops = check_stops(stops)
        self.pending = ""
        self.stopped: str | None = None   # the stop string that ended the text

    def feed(self, text: str) -> tuple[str, bool]:
        if self.stopped is not None:
            return "", True
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        first, which = -1, None
        for s in self.stops:
            i = self.pending.find(s)
            if i >= 0 and (first < 0 or i < first):
                first, which = i, s
        if which is not None:
            out, self.pending, self.stopped = self.pending[:first], "", which
            return out, True
        hold = self._held_back()
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold:]
        return out, False

    def _held_back(self) -> int:
        """Length of the longest tail of ``pending`` that begins a stop string."""
        p = self.pending
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(p)), best, -1):
                if p.endswith(s[:k]):
                    best = k
                    break
        return best

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return "" if self.stopped is not None else out


class TextAssembler:
    """Token ids in, text that may be shown out: incremental detokenization
    (a character split over tokens waits for its last byte) followed by stop
    strings. One per generation: ``feed`` each new token, ``finish`` at the
    end; ``stopped`` names the stop string that ended the text."""

    def __init__(self, tokenizer, prev_token: int | None, stops: Sequence[str] | str | None) -> None:
        self._dec = tokenizer.stream_decoder()
        self._prev = prev_token
        self._matcher = StopMatcher(stops)

    @property
    def stopped(self) -> str | None:
        return self._matcher.stopped

    def feed(self, token: int) -> tuple[str, bool]:
        text = self._dec.feed(self._prev, token)
        self._prev = token
        return self._matcher.feed(text)

    def finish(self) -> tuple[str, bool]:
        out, stopped = self._matcher.feed(self._dec.flush())
        return out + self._matcher.flush(), stopped
