"""A request as the engine carries it from admission to its finish."""
from __future__ import annotations

import itertools
import time
from typing import Any

from ..sampling import Sampler
from .block_manager import prefix_hashes
from .requests import Request

#: sequence keys: increasing with arrival, so a smaller key is an older sequence
_KEYS = itertools.count()


class Sequence:
    """The scheduler's state of one request (tokens, what the pool holds,
    its drafting length) and what the core samples and drafts it with.
    Detokenization and stop strings are the output stage's (``output``)."""

    def __init__(self, req: Request, sampler: Sampler, drafter: Any = None, draft_len: Any = None,
                 draft_sampler: Sampler | None = None) -> None:
        self.key = next(_KEYS)
        self.req = req
        self.tokens = list(req.prompt_ids)
        self.n_prompt = len(req.prompt_ids)
        self.computed = 0            # positions whose K/V rows are in the pool
        self.generated = 0
        self.cached_prompt = 0       # prompt tokens found in the pool on first admission
        self.admitted_once = False
        self.cancelled = False       # its requester went away: it leaves at the next step
        self.t_arrival = time.perf_counter()
        self.sampler = sampler
        self.drafter = drafter       # who drafts for it (None: plain decoding)
        self.draft_len = draft_len   # ``speculative.DraftLength`` when it drafts
        self.draft_sampler = draft_sampler
        self.draft_kv = 0            # positions whose rows a draft model's own pool holds
        #: context shifts (``runtime.context_shift``) and the tokens they dropped; None: the engine does not shift
        self.context_shifts: int | None = None
        self.shifted_tokens = 0
        #: why its grammar could not go on (``core._sample``): it ends with an error, not a token
        self.failed: str | None = None
        self._hashes: tuple[int, list[bytes]] = (-1, [])

    def shifted(self, kept: list[int], dropped: int) -> None:
        """Its tokens after a context shift (none of its rows are in the pool
        any more; the hashes of its blocks are computed again)."""
        self.tokens = kept
        self.computed = 0
        self.context_shifts = (self.context_shifts or 0) + 1
        self.shifted_tokens += dropped
        self._hashes = (-1, [])

    def block_hashes(self, block_size: int) -> list[bytes]:
        """The hashes of its tokens' full blocks (computed again only when the tokens grew)."""
        if self._hashes[0] != len(self.tokens):
            self._hashes = (len(self.tokens), prefix_hashes(self.tokens, block_size))
        return self._hashes[1]
