"""The records one engine step passes between its stages: what the
scheduler plans (``StepPlan``), what the core asks it to apply
(``SeqUpdate``), and what the step counted (``StepStats``)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .sequence import Sequence


@dataclass
class PromptChunk:
    """Positions of a sequence's prompt (or, after a preemption, of what it
    had) to run this step."""

    seq: Sequence
    positions: range

    @property
    def finishes(self) -> bool:
        """The chunk runs the sequence's last token: its logits give the next one."""
        return self.positions.stop == len(self.seq.tokens)


@dataclass
class StepPlan:
    """One step, as the scheduler decided it. Every sequence in ``decode``
    has room for its next row; every chunk for its positions."""

    #: generating sequences, oldest first: a row each (and the drafts it verifies)
    decode: list[Sequence] = field(default_factory=list)
    #: prompt chunks, oldest prompts first
    chunks: list[PromptChunk] = field(default_factory=list)
    #: decode rows and chunks in one call that returns only the rows needed
    #: (the executor selects rows and nobody drafts); else a call for the
    #: decode rows and one for the (single) chunk
    mixed: bool = False
    #: per decode sequence, tokens it may have drafted and verified this step
    draft_ns: list[int] = field(default_factory=list)
    #: (src, dst) block copies to make before anything runs (cached prompt
    #: blocks reused, shared blocks about to be written)
    copies: list[tuple[int, int]] = field(default_factory=list)
    #: sequences the scheduler ended: alone and still out of blocks (finish reason length)
    ended: list[Sequence] = field(default_factory=list)
    #: prompt tokens found in the pool at a sequence's first admission
    cached_prompt_tokens: int = 0
    #: sequences sent back to the queue to free blocks for older ones
    preemptions: int = 0
    #: sequences that filled the context and were shifted (sent back to be recomputed)
    context_shifts: int = 0

    @property
    def empty(self) -> bool:
        return not self.decode and not self.chunks


@dataclass
class SeqUpdate:
    """What one step did for one sequence, to apply in order."""

    seq: Sequence
    #: positions whose K/V rows are in the pool now
    computed: int
    #: the tokens those rows hold (the sequence's, and the drafts accepted)
    committed: list[int]
    #: tokens to append: what the output stage kept of the sampled ones
    tokens: list[int] = field(default_factory=list)
    #: drafted tokens verified and, of those, accepted
    drafted: int = 0
    accepted: int = 0
    #: the finish reason (stop, length), or None while it goes on
    finish: str | None = None


@dataclass
class StepStats:
    """What one step counted (``runtime.serve.metrics`` records them)."""

    prompt_tokens: int = 0          # run through the model (found in the pool: not counted)
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    preemptions: int = 0
    context_shifts: int = 0
    #: tokens chosen under a grammar's mask, and the seconds its masks took
    masked_steps: int = 0
    mask_s: float = 0.0
    #: sequences advanced by the step's decode rows (None: no decode rows ran)
    batch_size: int | None = None


@dataclass
class EngineLoad:
    """The engine's state after a step: queue, batch and KV pool."""

    waiting: int
    running: int
    kv_blocks_total: int
    kv_blocks_cached: int
    kv_blocks_used: int
