"""Running a step plan on the executor: one native call, or two.

Where the plan is ``mixed`` (the executor selects rows: every row of a batch
has the decode step's numbers), one call runs a row for every generating
sequence and the prompt chunks, returning logits only for the generating
rows and the last row of each prompt the step finishes (as vLLM's chunked
prefill does). Otherwise one call runs the generating rows (``decode=True``:
each with the arithmetic of the single-stream decode step, so a request's
tokens do not depend on who else is being served), drafted tokens as extra
rows of their sequence, and a second call the next chunk of the oldest
prompt, with the arithmetic of the single-stream prefill (only its last
row's logits come back). A drafter with KV rows of its own then follows that
prefill.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..speculative import Draft
from .plan import StepPlan
from .sequence import Sequence


@dataclass
class StepLogits:
    """The logits a step produced."""

    #: per decode sequence: [1 + drafted tokens, vocab], row i after its tokens and the first i drafts
    decode: list[np.ndarray] = field(default_factory=list)
    #: per prompt chunk: the logits after its last row when it finishes the prompt, else None
    chunks: list[np.ndarray | None] = field(default_factory=list)


class StepRunner:
    def __init__(self, executor: Any, table: Callable[[Sequence], list[int]], drafter: Any = None) -> None:
        """``table(seq)``: a sequence's block table now; ``drafter``: the
        engine's model drafter, whose own rows follow the prompts' (if it
        keeps any)."""
        self.ex = executor
        self.table = table
        self.drafter = drafter

    def run(self, plan: StepPlan, drafts: list[Draft]) -> StepLogits:
        if plan.mixed:
            return self._mixed(plan)
        out = StepLogits()
        if plan.decode:
            out.decode = self._decode(plan.decode, drafts)
        for c in plan.chunks:
            s, chunk = c.seq, c.positions
            logits = self.ex.batch(s.tokens[chunk.start: chunk.stop], list(chunk), [self.table(s)] * len(chunk),
                                   last_only=True)
            if self.drafter is not None:
                self.drafter.follow_prefill(s, chunk.stop, self.table(s))
            out.chunks.append(logits if c.finishes else None)
        return out

    def _mixed(self, plan: StepPlan) -> StepLogits:
        tokens: list[int] = []
        positions: list[int] = []
        tables: list[list[int]] = []
        select: list[int] = []
        for s in plan.decode:
            select.append(len(tokens))
            tokens.append(s.tokens[-1])
            positions.append(len(s.tokens) - 1)
            tables.append(self.table(s))
        for c in plan.chunks:
            s, chunk = c.seq, c.positions
            tokens += s.tokens[chunk.start: chunk.stop]
            positions += list(chunk)
            tables += [self.table(s)] * len(chunk)
            if c.finishes:
                select.append(len(tokens) - 1)
        logits = self.ex.batch(tokens, positions, padded(tables), select=select or [0])
        out = StepLogits([logits[i: i + 1] for i in range(len(plan.decode))])
        r = len(plan.decode)
        for c in plan.chunks:
            out.chunks.append(logits[r] if c.finishes else None)
            r += c.finishes
        return out

    def _decode(self, seqs: list[Sequence], drafts: list[Draft]) -> list[np.ndarray]:
        tokens: list[int] = []
        positions: list[int] = []
        tables: list[list[int]] = []
        for s, d in zip(seqs, drafts):
            p = len(s.tokens) - 1
            tokens += [s.tokens[-1], *d.tokens]
            positions += range(p, p + 1 + len(d.tokens))
            tables += [self.table(s)] * (1 + len(d.tokens))
        logits = self.ex.batch(tokens, positions, padded(tables), decode=True)
        out, r = [], 0
        for d in drafts:
            out.append(logits[r: r + 1 + len(d.tokens)])
            r += 1 + len(d.tokens)
        return out


def padded(tables: list[list[int]]) -> list[list[int]]:
    """Block tables as one rectangle (entries past a row's blocks are never read)."""
    width = max(len(t) for t in tables)
    return [t + [0] * (width - len(t)) for t in tables]
