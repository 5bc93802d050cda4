"""Continuous batching's policy: who runs this step, and how much of them.

Policy only: no threads, no executor, no sampling. ``schedule()`` plans one
step from the queue, the running sequences and the block manager; the core
runs the plan and hands back, sequence by sequence, what came of it
(``update``). Each step the scheduler

1. admits waiting sequences while their blocks fit the paged KV pool (a
   prompt sharing full blocks with one seen before starts past them), except
   one whose prompt shares full blocks with a prompt still being prefilled:
   it waits for those blocks and then shares them (SGLang's in-batch prefix
   caching), so prompts that arrive together with one system prompt prefill
   it once;
2. gives every generating sequence a row (its next token), with room in the
   pool for it;
3. gives prompts up to ``prefill_chunk`` tokens, oldest first, so a long
   prompt never stalls the others' tokens for long: in the same call as the
   decode rows where the executor selects rows and nobody drafts
   (``mixed``), else one prompt's chunk in a call of its own;
4. shares the rows the step has left among the sequences that draft
   (``share_rows``), each up to what its ``DraftLength`` asks.

A sequence that needs a block when none is left preempts the youngest
running one, which goes back to the front of the queue and is recomputed
later (its prompt and what it has generated so far; cached blocks make that
cheap); one that finds nothing younger waits for older ones to finish, and
alone it can only stop.

With ``context_shift``, a generating sequence whose next row would be past
the context is shifted (``runtime.context_shift``): its first
``req.keep`` tokens stay, the oldest half of the rest goes, and it goes back
to the front of the queue as a preempted one does, to be recomputed at the
new positions (its kept prefix's full blocks are in the pool's cache, so
they are not run again).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..context_shift import shift_tokens
from .block_manager import BlockManager, OutOfBlocks, common_run
from .plan import PromptChunk, SeqUpdate, StepPlan
from .sequence import Sequence


@dataclass(frozen=True)
class SchedulerLimits:
    """What a step can hold."""

    #: sequences advanced together
    max_batch: int
    #: prompt tokens per step
    prefill_chunk: int
    #: rows one call takes (the compiled plan's T)
    max_rows: int
    #: decode rows one call takes, drafted rows included
    max_decode_rows: int
    #: the longest a sequence may be
    ctx: int
    #: the executor runs decode rows and prompt chunks in one call, selecting rows
    can_select: bool = False
    #: the engine has a model drafter for every request (a sequence with a
    #: drafter needs its drafted rows' logits: no mixed calls then)
    engine_drafter: bool = False
    #: that drafter keeps KV rows of its own, which may lag the target's by
    #: a sequence's last accepted draft: only blocks both hold are cached
    draft_rows_lag: bool = False
    #: a sequence that fills the context is shifted and goes on (else it ends with ``length``)
    context_shift: bool = False
    #: every layer attends to the last ``window`` positions only (Mistral): the blocks a
    #: sequence's window has passed go back to the pool as it advances (0: none do)
    window: int = 0


class Scheduler:
    def __init__(self, blocks: BlockManager, limits: SchedulerLimits) -> None:
        self.blocks = blocks
        self.limits = limits
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    # --- the queue -------------------------------------------------------------------------
    def add(self, s: Sequence) -> None:
        self.waiting.append(s)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def cancel(self, req_id: str) -> None:
        """Mark the sequences of request ``req_id`` (its client went away)
        to leave at the next step (``drop_cancelled``)."""
        for s in list(self.running) + list(self.waiting):
            if s.req.id == req_id:
                s.cancelled = True

    def drop_cancelled(self) -> list[Sequence]:
        """Remove the cancelled sequences; their blocks are freed."""
        gone = [s for s in list(self.running) + list(self.waiting) if s.cancelled]
        for s in gone:
            self.finish(s)
        return gone

    def finish_all(self) -> list[Sequence]:
        """Remove every sequence (a drain's deadline, an engine failure)."""
        gone = list(self.running) + list(self.waiting)
        for s in gone:
            self.finish(s)
        return gone

    def finish(self, s: Sequence) -> bool:
        """Remove ``s`` and free its blocks; False if it was gone already."""
        if s in self.running:
            self.running.remove(s)
            self.blocks.release(s.key)
        elif s in self.waiting:
            self.waiting.remove(s)
        else:
            return False
        return True

    # --- planning ----------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """The next step (see the module docstring)."""
        plan = StepPlan()
        if self.limits.context_shift:
            self._shift_full(plan)
        self._admit(plan)
        lim = self.limits
        # oldest first: a sequence may only preempt younger ones, so each later
        # one checks it is still running
        decoding, prefilling = [], []
        for s in sorted(self.running, key=lambda x: x.key):
            if s not in self.running:
                continue
            if s.computed == len(s.tokens) - 1:
                if self._writable(s, range(s.computed, s.computed + 1), plan):
                    decoding.append(s)
                else:
                    self._preempt_self(s, plan)
            else:
                prefilling.append(s)
        decoding = [s for s in decoding if s in self.running]
        mixed = self._can_mix(decoding + prefilling)
        budget = min(lim.prefill_chunk, lim.max_rows - len(decoding)) if mixed else lim.prefill_chunk
        chunks: list[PromptChunk] = []
        for s in prefilling:
            if budget <= 0 or (chunks and not mixed):
                break
            if s not in self.running:
                continue
            lo = s.computed
            hi = min(len(s.tokens), lo + budget)
            if self._writable(s, range(lo, hi), plan):
                chunks.append(PromptChunk(s, range(lo, hi)))
                budget -= hi - lo
            else:
                self._preempt_self(s, plan)
        plan.decode = [s for s in decoding if s in self.running]
        plan.chunks = [c for c in chunks if c.seq in self.running]
        plan.mixed = mixed and bool(plan.chunks)
        if plan.decode and not plan.mixed:
            plan.draft_ns = self._draft_shares(plan.decode)
        return plan

    def _shift_full(self, plan: StepPlan) -> None:
        """Shift every generating sequence whose next row would be past
        the context and send it back to be recomputed (its blocks freed)."""
        ctx = self.limits.ctx
        for s in sorted(self.running, key=lambda x: x.key, reverse=True):
            if len(s.tokens) <= ctx or s.computed != len(s.tokens) - 1:   # its next row is inside
                continue
            kept, dropped = shift_tokens(s.tokens, s.req.keep, ctx - 1)
            s.shifted(kept, dropped)
            self._send_back(s)   # the youngest goes in first: the oldest ends up first in line
            plan.context_shifts += 1

    def _can_mix(self, seqs: list[Sequence]) -> bool:
        """One call for decode rows and prompt chunks: the executor selects
        rows, and no sequence drafts (drafted rows need their own logits)."""
        return (self.limits.can_select and not self.limits.engine_drafter
                and all(s.drafter is None for s in seqs))

    def _draft_shares(self, seqs: list[Sequence]) -> list[int]:
        """Per sequence, the tokens it may draft this step: what its draft
        length asks, within its max_tokens and the context, the step's rows
        shared fairly."""
        wants = []
        for s in seqs:
            n = s.draft_len.next() if s.draft_len is not None else 0
            wants.append(max(0, min(n, s.req.max_tokens - s.generated - 1, self.limits.ctx - len(s.tokens))))
        return share_rows(wants, self.limits.max_decode_rows - len(seqs))

    def _admit(self, plan: StepPlan) -> None:
        """Waiting sequences in order while there is room, except one whose
        prompt shares full blocks with a prompt still being prefilled: it
        waits until they are in the pool and then shares them, rather than
        computing them beside it. It loses no time: prefill goes oldest
        first anyway."""
        for s in list(self.waiting):
            if len(self.running) >= self.limits.max_batch:
                return
            if self._prefix_in_flight(s):
                continue
            try:
                _, cached = self.blocks.allocate(s.key, s.tokens, s.block_hashes(self.blocks.block_size))
            except OutOfBlocks:
                return
            self.waiting.remove(s)
            plan.copies += self.blocks.copies(s.key)    # a cached block's first positions, reused
            # at least the last token runs: its logits give the next one
            s.computed = s.draft_kv = min(cached, len(s.tokens) - 1)
            if not s.admitted_once:
                s.cached_prompt, s.admitted_once = s.computed, True
                plan.cached_prompt_tokens += s.computed
            self.running.append(s)

    def _prefix_in_flight(self, s: Sequence) -> bool:
        """A running sequence is prefilling full blocks that ``s``'s prompt
        starts with and the pool does not hold yet."""
        bs = self.blocks.block_size
        mine = s.block_hashes(bs)
        have = self.blocks.cached_run(mine)
        if have == len(mine):
            return False
        for r in self.running:
            if r.computed >= len(r.tokens) - 1:
                continue      # generating: its blocks so far are in the pool (or never will be)
            n = common_run(mine, r.block_hashes(bs))
            if n > have and r.computed < n * bs:
                return True
        return False

    def _writable(self, s: Sequence, positions: range, plan: StepPlan) -> bool:
        """Blocks for ``positions`` of ``s``, copying shared ones; False when
        the pool is full even after preempting everything younger."""
        for p in positions:
            while True:
                try:
                    plan.copies += self.blocks.ensure(s.key, p)
                    break
                except OutOfBlocks:
                    if not self._preempt_younger_than(s, plan):
                        return False
        return True

    def _preempt_younger_than(self, s: Sequence, plan: StepPlan) -> bool:
        victims = [v for v in self.running if v is not s and v.key > s.key]
        if not victims:
            return False
        self._send_back(max(victims, key=lambda x: x.key))
        plan.preemptions += 1
        return True

    def _preempt_self(self, s: Sequence, plan: StepPlan) -> None:
        """No block for ``s`` even after preempting younger ones: it waits for
        older ones to finish; alone, it has the whole pool and can only stop."""
        if len(self.running) == 1:
            self.finish(s)
            plan.ended.append(s)
            return
        self._send_back(s)

    def _send_back(self, s: Sequence) -> None:
        """``s`` leaves the batch and its blocks go back: first in line, to be
        recomputed (prompt and generated so far) when there is room again."""
        self.running.remove(s)
        self.blocks.release(s.key)
        s.computed = 0
        self.waiting.appendleft(s)

    # --- drafts ------------------------------------------------------------------------------
    def reserve(self, s: Sequence, n: int) -> tuple[int, list[tuple[int, int]]]:
        """Blocks for the ``n`` positions after ``s``'s tokens, without
        preempting anyone (a draft never does): how many (from the first)
        have one, and the block copies to make before they are written."""
        start = len(s.tokens)
        copies: list[tuple[int, int]] = []
        for k in range(n):
            try:
                copies += self.blocks.ensure(s.key, start + k)
            except OutOfBlocks:
                return k, copies
        return n, copies

    def table(self, s: Sequence) -> list[int]:
        return self.blocks.table(s.key)

    # --- results -----------------------------------------------------------------------------
    def update(self, u: SeqUpdate) -> None:
        """Apply what a step did for one sequence (in the order the step ran
        them): its drafting length learns from the verdict, the pool's new
        full blocks are cached for later prompts, the kept tokens join the
        sequence, and a finished one leaves with its blocks."""
        s = u.seq
        if u.drafted:
            s.draft_len.update(u.drafted, u.accepted)
            # the KV rows of the accepted drafts stay (the draft's own too); a rejected one's row is written
            # again later
            s.draft_kv = min(s.draft_kv, len(s.tokens) + u.accepted)
        s.computed = u.computed
        # only the full blocks both pools hold (a draft model's rows may lag by its last accepted draft)
        n = min(s.computed, s.draft_kv) if self.limits.draft_rows_lag else s.computed
        self.blocks.commit(s.key, u.committed[:n])
        if self.limits.window and u.finish is None:
            # the next row (at position n at the earliest) reads from n - window + 1 on
            self.blocks.slide(s.key, n - self.limits.window + 1)
        s.tokens += u.tokens
        s.generated += len(u.tokens)
        if u.finish is not None:
            self.finish(s)


def share_rows(wants: list[int], room: int) -> list[int]:
    """Rows for each want, at most ``room`` in all: equal shares, no one
    more than it wants, the oldest (first) taking what does not divide."""
    got = [0] * len(wants)
    while room > 0:
        hungry = [i for i, w in enumerate(wants) if got[i] < w]
        if not hungry:
            break
        each = max(1, room // len(hungry))
        for i in hungry:
            g = min(each, wants[i] - got[i], room)
            got[i] += g
            room -= g
            if room == 0:
                break
    return got
