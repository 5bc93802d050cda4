"""Speculative decoding: a drafter proposes tokens, the target checks them
all in one batched pass and keeps what it would have produced itself.

Decoding one token reads every weight once; checking k drafted tokens in one
``verify`` step reads them once for k + 1 rows, so each accepted draft is a
token almost for free. Three drafters share one interface (``Drafter``):

* ``LookupDrafter`` (``--lookup N``): the continuation of the longest
  earlier occurrence of the last (up to N) tokens in the prompt and output
  so far. No second model; strong where the output quotes its input.
* ``ModelDrafter`` over a smaller model of the same vocabulary (``--draft``),
  with its own KV cache; or over the target's own first K layers plus its
  final norm and head (``--draft-layers``), whose KV rows for those layers
  are the target's own (``runtime.model`` builds that executor).

Verification (``accept``) runs on rows computed exactly as decode steps
compute them (the ``verify`` entry), so greedy output equals plain decoding
token for token; sampling takes the standard rejection rule: accept a draft
d with probability min(1, p(d)/q(d)), else draw from the normalised
max(0, p - q); a deterministic draft (lookup) has q one-hot at d. The KV
cache is indexed by position and attention reads only rows below a step's
positions, so rolling back past a rejected token is setting the position:
the next step overwrites the stale rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

from .sampling import Sampler, SamplerConfig

#: tokens drafted per verify step at most, unless --draft-max says otherwise
DEFAULT_DRAFT_MAX = 8
#: --draft-max limit: a verify step must fit one prefill chunk with room to spare
MAX_DRAFT_MAX = 64


class SpeculationError(ValueError):
    """A speculation setting that cannot work (other vocabulary, too many layers ...)."""


@dataclass
class Speculation:
    """Which drafter, and how many tokens it may propose per step.
    Exactly one of ``lookup`` (n-gram length), ``draft`` (a model file or a
    loaded ``Model``) and ``draft_layers`` (K) is set."""

    lookup: int = 0
    draft: object = None
    draft_layers: int = 0
    draft_max: int = DEFAULT_DRAFT_MAX
    #: with ``draft``: its tokenizer file (llama2.c models), else None
    draft_tokenizer: str | None = None

    def validate(self) -> None:
        chosen = [n for n, on in (("--lookup", self.lookup), ("--draft", self.draft is not None),
                                  ("--draft-layers", self.draft_layers)) if on]
        if len(chosen) != 1:
            raise SpeculationError("speculative decoding takes one drafter: --lookup N, --draft MODEL or "
                                   f"--draft-layers K (got {', '.join(chosen) or 'none'})")
        if self.lookup < 0 or self.draft_layers < 0:
            raise SpeculationError("--lookup and --draft-layers take a positive number")
        if not 1 <= self.draft_max <= MAX_DRAFT_MAX:
            raise SpeculationError(f"--draft-max {self.draft_max}: must be between 1 and {MAX_DRAFT_MAX}")

    @property
    def kind(self) -> str:
        return "lookup" if self.lookup else "draft" if self.draft is not None else "draft-layers"


@dataclass
class Draft:
    """Proposed tokens and, for a sampled draft, the distribution each was
    drawn from (None: deterministic, q one-hot at the token)."""

    tokens: list[int] = field(default_factory=list)
    q: list[np.ndarray] | None = None


class Drafter(Protocol):
    """Proposes up to ``n`` tokens to follow ``history`` (prompt and output
    so far, its last token not yet in the target's KV cache)."""

    name: str

    def begin(self, config: SamplerConfig) -> None:
        """A generation starts, sampling with ``config``."""

    def sync(self, cached: Sequence[int]) -> None:
        """The target's KV cache now holds the rows of ``cached``."""

    def propose(self, history: Sequence[int], n: int) -> Draft: ...

    def close(self) -> None: ...


# --- prompt lookup ------------------------------------------------------------------------
class LookupDrafter:
    """Prompt lookup decoding: find the longest suffix of the history (at
    most ``ngram`` tokens, at least 1) that occurred before, latest
    occurrence first, and propose what followed it there."""

    name = "lookup"

    def __init__(self, ngram: int) -> None:
        self.ngram = max(1, int(ngram))

    def begin(self, config: SamplerConfig) -> None:
        pass

    def sync(self, cached: Sequence[int]) -> None:
        pass

    def propose(self, history: Sequence[int], n: int) -> Draft:
        return Draft(lookup_continuation(history, self.ngram, n))

    def close(self) -> None:
        pass


def lookup_continuation(history: Sequence[int], ngram: int, n: int) -> list[int]:
    """Up to ``n`` tokens that followed the latest earlier occurrence of the
    longest suffix of ``history`` of ``ngram`` tokens or fewer; [] if none."""
    h = np.asarray(history, np.int64)
    L = len(h)
    if n < 1 or L < 2:
        return []
    for size in range(min(ngram, L - 1), 0, -1):
        suffix = h[L - size:]
        # windows h[i:i+size] for i < L - size (an occurrence ending before the suffix's start + size)
        starts = np.flatnonzero(h[: L - size] == suffix[0])
        for i in starts[::-1]:   # latest first: the nearest context repeats best
            if i + size < L and np.array_equal(h[i: i + size], suffix):
                cont = h[i + size: i + size + n]
                if len(cont):
                    return [int(t) for t in cont]
    return []


# --- a draft model ---------------------------------------------------------------------
class ModelDrafter:
    """Drafts with a smaller model (or the target's first layers) decoding
    ahead on its own executor. ``shared_cache``: the executor's KV rows are
    the target's (``--draft-layers``), so every row the target has verified
    is already there, and only the rows drafted since need recomputing."""

    def __init__(self, executor, vocab_size: int, name: str, shared_cache: bool = False,
                 owner: object = None) -> None:
        self.executor = executor
        self.vocab_size = vocab_size
        self.name = name
        self.shared_cache = shared_cache
        self.owner = owner   # what keeps the executor alive (a draft Model), if anything
        self.begin(SamplerConfig())
        self._kv: list[int] = []   # the ids whose K/V rows this executor's cache holds

    def begin(self, config: SamplerConfig) -> None:
        self.sampler = draft_sampler(config, self.vocab_size)
        self.greedy = config.temperature == 0.0

    def sync(self, cached: Sequence[int]) -> None:
        if self.shared_cache:   # the target wrote these rows, in our layers too
            self._kv = list(cached)

    def propose(self, history: Sequence[int], n: int) -> Draft:
        hist = list(history)
        ex = self.executor
        if n < 1 or len(hist) >= ex.ctx:   # no room in the draft's context
            return Draft()
        start = common_prefix(hist, self._kv)
        start = min(start, len(hist) - 1)
        if len(hist) - start == 1:
            logits = ex.decode(hist[-1], start)
        else:
            if start == 0 and not self.shared_cache:
                ex.reset()
            logits = ex.prefill(hist[start:], start)
        self._kv = list(hist)
        toks: list[int] = []
        qs: list[np.ndarray] = []
        pos = len(hist)
        for i in range(n):
            t, q = sample_draft(self.sampler, logits, hist)
            if q is not None:
                qs.append(q)
            toks.append(t)
            hist.append(t)
            if i == n - 1 or pos >= ex.ctx:
                break
            logits = ex.decode(t, pos)
            self._kv.append(t)
            pos += 1
        return Draft(toks, None if self.greedy else qs)

    def close(self) -> None:
        close = getattr(self.executor, "close", None)
        if close is not None:
            close()


def draft_sampler(config: SamplerConfig, vocab_size: int) -> Sampler:
    """A draft model samples as the target does (the same temperature and
    cuts), from its own stream of coins."""
    cfg = SamplerConfig(**config.__dict__)
    cfg.seed = None if cfg.seed is None else cfg.seed + 0x5EED
    return Sampler(cfg, vocab_size)


def sample_draft(sampler: Sampler, logits: np.ndarray, history: Sequence[int]) -> tuple[int, np.ndarray | None]:
    """One drafted token and the distribution it was drawn from (None when
    greedy: the rule then only compares it with the target's choice)."""
    if sampler.config.temperature == 0.0:
        return sampler.sample(logits, history), None
    q = sampler.probs(logits, history)
    return sampler.draw(q), q


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share (the KV rows still valid)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


# --- verification ------------------------------------------------------------------------
def accept(rows: np.ndarray, draft: Draft, sampler: Sampler, history: Sequence[int]) -> tuple[int, int]:
    """(drafted tokens accepted, the token that follows them) given the
    target's logits ``rows``: row i is the target's next-token logits after
    ``history`` + draft.tokens[:i] (one more row than drafted tokens).

    Greedy: a draft is accepted while it is the target's own choice, which
    then comes from ``sampler.sample`` exactly as plain decoding picks it.
    Sampling: accept d with probability min(1, p(d)/q(d)); on a rejection
    the token comes from the normalised max(0, p - q), after all accepted
    ones from p itself; the output is distributed as the target's."""
    hist = list(history)
    greedy = sampler.config.temperature == 0.0
    for i, d in enumerate(draft.tokens):
        if greedy:
            t = sampler.sample(rows[i], hist)
            if t != d:
                return i, t
        else:
            p = sampler.probs(rows[i], hist)
            q_d = 1.0 if draft.q is None else float(draft.q[i][d])
            if not (q_d > 0 and sampler.uniform() < min(1.0, p[d] / q_d)):
                if draft.q is None:
                    resid = p.copy()
                    resid[d] = 0.0
                else:
                    resid = np.maximum(p - draft.q[i], 0.0)
                if resid.sum() <= 0:   # p == q: the rejection had probability zero; keep p
                    resid = p
                return i, sampler.draw(resid)
        hist.append(d)
    return len(draft.tokens), sampler.sample(rows[len(draft.tokens)], hist)


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
