"""The sampling side of speculation: how a draft model draws its tokens, and
the rule by which the target keeps them.

Verification runs on rows computed exactly as decode steps compute them (the
``verify`` entry, or the batch step's decode rows), so greedy output equals
plain decoding token for token; sampling takes the standard rejection rule:
accept a draft d with probability min(1, p(d)/q(d)), else draw from the
normalised max(0, p - q); a deterministic draft (lookup) has q one-hot at d.
"""
from __future__ import annotations

import dataclasses

from typing import Any, Sequence

import numpy as np

from ..sampling import Sampler, SamplerConfig
from .protocol import Draft


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


def grammar_checked(draft: Draft, grammar: Any) -> Draft:
    """The draft cut before its first token the grammar refuses (verifying
    it would be wasted: the target's masked choice can never be it)."""
    n = grammar.valid_prefix(draft.tokens)
    if n == len(draft.tokens):
        return draft
    return dataclasses.replace(draft, tokens=draft.tokens[:n], q=None if draft.q is None else draft.q[:n])


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
    grammar = getattr(sampler, "grammar", None)   # sample() keeps it in step; the sampled path does so here
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
                t = sampler.draw(resid)
                if grammar is not None:
                    grammar.accept(t)
                return i, t
            if grammar is not None:
                grammar.accept(d)
        hist.append(d)
    return len(draft.tokens), sampler.sample(rows[len(draft.tokens)], hist)
