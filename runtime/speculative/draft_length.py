"""How many tokens to draft next, from how the last drafts fared."""
from __future__ import annotations


class DraftLength:
    """How many tokens to draft next: up to ``limit``, growing while drafts
    are accepted whole, shrinking to just past the last accepted one when a
    draft is cut short. A draft rejected outright pauses drafting for 1, 2,
    4 ... steps (plain decode steps), reset by the next accepted token: a
    drafter that keeps guessing wrong costs a verify step now and then,
    not every step."""

    #: the longest pause, in steps
    MAX_PAUSE = 32

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.n = limit
        self._pause = 0
        self._backoff = 1

    def next(self) -> int:
        """Tokens to draft this step (0: decode plainly)."""
        if self._pause > 0:
            self._pause -= 1
            return 0
        return self.n

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        if accepted == 0:
            self._pause = self._backoff
            self._backoff = min(self.MAX_PAUSE, 2 * self._backoff)
        else:
            self._backoff = 1
        if accepted == drafted:
            self.n = min(self.limit, self.n + 2)
        else:
            self.n = max(1, accepted + 1)
