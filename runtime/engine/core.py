"""The engine core: a step is schedule -> execute -> update.

``EngineCore.step()`` asks the scheduler for a plan (``scheduler``), makes
the plan's block copies, lets the drafters propose for the generating
sequences (``runtime.speculative``: the engine's draft model, or prompt
lookup where a request asks; blocks for drafted positions come from the
scheduler without preempting anyone), runs the plan (``runner``: one native
call or two), samples each sequence's tokens with its own sampler (a
drafting sequence keeps the drafts the model agrees with:
``speculative.accept``; greedy, its output is the one plain decoding gives,
token for token), turns them into events (``output``) and hands the
scheduler what came of each sequence (``Scheduler.update``). No threads:
``engine_thread`` runs it for ``lmc serve``, the tests step it by hand.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence as Seq

from ..context_shift import shift_tokens
from ..errors import ConstraintError
from ..sampling import Sampler
from ..speculative import (MAX_DRAFT_MAX, Draft, Drafter, DraftLength, LookupDrafter, accept, draft_sampler,
                           grammar_checked)
from .block_manager import BlockManager
from .output import OutputProcessor
from .plan import EngineLoad, SeqUpdate, StepPlan, StepStats
from .requests import EngineError, Event, Request
from .runner import StepLogits, StepRunner
from .scheduler import Scheduler, SchedulerLimits
from .sequence import Sequence


@dataclass
class StepOutput:
    """What a step gives the requesters: events in order, and the sequences
    that finished (or were removed) during it."""

    events: list[tuple[Request, Event]] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)
    stats: StepStats = field(default_factory=StepStats)


class EngineCore:
    def __init__(self, executor: Any, tokenizer: Any, stop_ids: Seq[int], vocab: int, max_batch: int,
                 prefill_chunk: int = 64, drafter: Drafter | None = None, context_shift: bool = False) -> None:
        """``max_batch``: sequences advanced together; ``drafter``: the
        draft model requests use unless they ask for prompt lookup
        (``runtime.speculative.build.build_drafter``), or None.
        ``context_shift``: a sequence that fills the context is shifted
        (``runtime.context_shift``: its request's ``keep`` first tokens
        stay) and goes on to its max_tokens, instead of ending with length;
        a prompt longer than the context is shifted to fit."""
        self.context_shift = bool(context_shift)
        self.ex = executor
        self.vocab = vocab
        self.ctx = int(executor.pool.ctx)
        rows = executor.max_rows or prefill_chunk
        prefill_chunk = max(1, min(prefill_chunk, rows))
        max_batch = min(max(1, int(max_batch)), rows, executor.max_batch or rows)
        self.max_batch, self.prefill_chunk = max_batch, prefill_chunk
        self.blocks = BlockManager(executor.n_blocks, executor.block_size)
        self.drafter = drafter
        #: the drafter whose own pool must follow every sequence (a draft model of its own), or None
        self.keeper = drafter if drafter is not None and drafter.own_kv else None
        self.scheduler = Scheduler(self.blocks, SchedulerLimits(
            max_batch=max_batch, prefill_chunk=prefill_chunk, max_rows=rows,
            max_decode_rows=executor.max_batch or max_batch, ctx=self.ctx,
            can_select=getattr(executor, "can_select", False), engine_drafter=drafter is not None,
            draft_rows_lag=self.keeper is not None, context_shift=self.context_shift,
            window=int(getattr(executor.pool, "window", 0) or 0)))
        self.output = OutputProcessor(tokenizer, stop_ids, self.ctx, self.context_shift)
        #: what a sequence whose grammar admits nothing more gets: its end
        self.eos = next(iter(stop_ids), 0)
        self.runner = StepRunner(executor, self.scheduler.table, drafter)
        self.copier = BlockCopier(executor, drafter)
        self.room = _SchedulerRoom(self.scheduler, self.copier)
        self._lookups: dict[int, LookupDrafter] = {}   # one per n-gram length
        self.steps = 0

    # --- requests ----------------------------------------------------------------------------
    def check(self, req: Request) -> None:
        """Raise EngineError if a request can never run here. With context
        shift, a prompt that leaves no room to generate is shifted first
        (``req.prompt_ids`` changes; ``req.shifted_prompt`` counts what went)."""
        prompt_ids, max_tokens = req.prompt_ids, req.max_tokens
        if not prompt_ids:
            raise EngineError("the prompt is empty")
        if self.context_shift:
            if not 0 <= req.keep < self.ctx - 1:
                raise EngineError(f"keep {req.keep}: must be between 0 and the context minus 2 ({self.ctx - 2})")
            req.prompt_ids, req.shifted_prompt = shift_tokens(prompt_ids, req.keep, self.ctx - 1)
            prompt_ids = req.prompt_ids
        if len(prompt_ids) >= self.ctx:
            raise EngineError(f"the prompt is {len(prompt_ids)} tokens; the context is {self.ctx} (one more "
                              f"position is needed to generate)")
        if self.blocks.blocks_for(len(prompt_ids) + 1) > self.blocks.n_blocks:
            raise EngineError(f"the prompt needs more KV blocks than the pool has ({self.blocks.n_blocks})")
        if max_tokens < 1:
            raise EngineError("max_tokens must be at least 1")
        if len(prompt_ids) + max_tokens > self.ctx and not self.context_shift:
            raise EngineError(f"the context is {self.ctx} tokens; the request needs {len(prompt_ids) + max_tokens} "
                              f"({len(prompt_ids)} in the prompt, max_tokens {max_tokens}): shorten the prompt or "
                              f"lower max_tokens")
        bad = [t for t in prompt_ids if not 0 <= int(t) < self.vocab]
        if bad:
            raise EngineError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab - 1})")
        if req.lookup < 0 or not 0 <= req.draft_max <= MAX_DRAFT_MAX:
            raise EngineError(f"lookup must be 0 or an n-gram length, and draft_max between 0 (no speculation) and "
                              f"{MAX_DRAFT_MAX} (got {req.lookup}, {req.draft_max})")
        bias = [t for t in (req.sampling.logit_bias or {}) if not 0 <= t < self.vocab]
        if bias:
            raise EngineError(f"logit_bias: token id {bias[0]} is outside the vocabulary (0..{self.vocab - 1})")
        req.sampling.validate()

    def add(self, req: Request) -> Sequence:
        """Queue a checked request."""
        drafter = self._drafter_for(req)
        s = Sequence(req, Sampler(req.sampling, self.vocab, req.grammar), drafter,
                     DraftLength(req.draft_max) if drafter is not None else None,
                     draft_sampler(req.sampling, self.vocab) if drafter is not None else None)
        if self.context_shift:
            s.context_shifts = int(req.shifted_prompt > 0)
            s.shifted_tokens = req.shifted_prompt
        self.output.add(s)
        self.scheduler.add(s)
        return s

    def _drafter_for(self, req: Request) -> Drafter | None:
        if req.draft_max == 0:
            return None
        if req.lookup > 0:
            return self._lookups.setdefault(req.lookup, LookupDrafter(req.lookup))
        return self.drafter

    def cancel(self, req_id: str) -> None:
        """A request nobody listens to any more: it leaves at ``drop_cancelled`` (no event)."""
        self.scheduler.cancel(req_id)

    def drop_cancelled(self) -> list[Sequence]:
        gone = self.scheduler.drop_cancelled()
        for s in gone:
            self.output.drop(s)
        return gone

    def end_all(self, reason: str, error: str | None = None) -> StepOutput:
        """End every sequence now, each with a last event (``reason``)."""
        out = StepOutput()
        for s in self.scheduler.finish_all():
            out.events.append((s.req, self.output.ended(s, reason, error)))
            out.finished.append(s)
        return out

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def current_load(self) -> EngineLoad:
        bm = self.blocks
        return EngineLoad(len(self.scheduler.waiting), len(self.scheduler.running), bm.n_blocks,
                          len(bm.evictable), bm.n_blocks - len(bm.free) - len(bm.evictable))

    # --- the step ---------------------------------------------------------------------------
    def step(self, out: StepOutput | None = None) -> StepOutput:
        """One step; ``out`` (filled as the step goes, so a caller has what
        was decided even when the step fails half-way) is returned."""
        out = out if out is not None else StepOutput()
        plan = self.scheduler.schedule()
        st = out.stats
        st.cached_prompt_tokens, st.preemptions = plan.cached_prompt_tokens, plan.preemptions
        st.context_shifts = plan.context_shifts
        for s in plan.ended:
            out.events.append((s.req, self.output.ended(s, "length")))
            out.finished.append(s)
        self.copier.copy(plan.copies)
        drafts = self._draft(plan) if plan.decode and not plan.mixed else [Draft() for _ in plan.decode]
        logits = self.runner.run(plan, drafts)
        if plan.decode:
            st.batch_size = len(plan.decode)
        for u, toks, rows in self._sample(plan, drafts, logits, st):
            if u.seq.failed is not None:   # its grammar could not go on: it ends with an error, alone
                u.finish = "error"
                out.events.append((u.seq.req, self.output.ended(u.seq, "error", u.seq.failed,
                                                                u.seq.sampler.grammar.constraint.param)))
                self.scheduler.update(u)
                out.finished.append(u.seq)
                continue
            emitted = self.output.process(u.seq, toks, rows)
            u.tokens, u.finish = toks[: emitted.kept], emitted.finish
            st.generated_tokens += emitted.kept
            out.events += [(u.seq.req, ev) for ev in emitted.events]
            self.scheduler.update(u)
            if u.finish is not None:
                out.finished.append(u.seq)
        self.steps += 1
        return out

    def _sample(self, plan: StepPlan, drafts: list[Draft], logits: StepLogits, st: StepStats):
        """Per sequence of the step, in order: its update (tokens to come),
        the tokens it sampled and the logits row of each."""
        for s, d, rows in zip(plan.decode, drafts, logits.decode):
            if s.computed < s.n_prompt:   # a decode row that ran a prompt's last token
                st.prompt_tokens += 1
            n = len(d.tokens)
            if not n:
                yield SeqUpdate(s, len(s.tokens), s.tokens), [_sample(s, rows[0], st, self.eos)], [rows[0]]
                continue
            try:
                n_ok, nxt = accept(rows, d, s.sampler, s.tokens)
            except ConstraintError as e:
                s.failed = _grammar_failure(s, e)
                yield SeqUpdate(s, len(s.tokens), s.tokens), [], []
                continue
            st.draft_tokens += n
            st.accepted_tokens += n_ok
            yield (SeqUpdate(s, len(s.tokens) + n_ok, s.tokens + d.tokens[:n_ok], drafted=n, accepted=n_ok),
                   [*d.tokens[:n_ok], nxt], list(rows[: n_ok + 1]))
        for c, row in zip(plan.chunks, logits.chunks):
            st.prompt_tokens += len(c.positions)
            s = c.seq
            if row is None:
                yield SeqUpdate(s, c.positions.stop, s.tokens), [], []
            else:
                yield SeqUpdate(s, c.positions.stop, s.tokens), [_sample(s, row, st, self.eos)], [row]

    def _draft(self, plan: StepPlan) -> list[Draft]:
        """Per decode sequence, the tokens its drafter proposes within its
        share (``plan.draft_ns``). Each drafter proposes for all its
        sequences at once; a draft model with a pool of its own also hears
        of every other sequence, to keep its rows."""
        seqs, ns = plan.decode, plan.draft_ns
        groups: dict[Drafter, list[int]] = {}
        for i, s in enumerate(seqs):
            if self.keeper is not None:
                groups.setdefault(self.keeper, []).append(i)
            if ns[i] > 0 and s.drafter is not self.keeper:
                groups.setdefault(s.drafter, []).append(i)
        out = [Draft() for _ in seqs]
        for drafter, idx in groups.items():
            mine = [ns[i] if seqs[i].drafter is drafter else 0 for i in idx]
            for i, d in zip(idx, drafter.propose([seqs[i] for i in idx], mine, self.room)):
                if d.tokens:
                    g = seqs[i].sampler.grammar   # drafts the grammar refuses are not verified
                    out[i] = d if g is None else grammar_checked(d, g)
        return out



def _sample(s: Sequence, row: Any, st: StepStats, eos: int) -> int:
    """A sequence's next token from its logits row; a grammar's mask counted.
    A grammar its matcher cannot follow further (a parser limit: an ambiguous
    grammar's rows grow with the output) sets ``s.failed``: the step ends
    that sequence alone with an error (it ended as a plain ``stop`` with
    ``eos`` before, its output cut short and called complete)."""
    g = s.sampler.grammar
    if g is None:
        return s.sampler.sample(row, s.tokens)
    t0 = g.mask_s
    try:
        tok = s.sampler.sample(row, s.tokens)
    except ConstraintError as e:
        s.failed = _grammar_failure(s, e)
        tok = eos
    st.masked_steps += 1
    st.mask_s += g.mask_s - t0
    return tok


def _grammar_failure(s: Sequence, e: ConstraintError) -> str:
    g = s.sampler.grammar
    return (f"{g.constraint.kind.replace('_', ' ')}: cannot be enforced past {s.generated} generated tokens "
            f"({e})")


class BlockCopier:
    """Makes the block manager's (src, dst) copies, in the pool and the
    engine drafter's own (if it keeps one)."""

    def __init__(self, executor: Any, drafter: Drafter | None) -> None:
        self.ex = executor
        self.drafter = drafter

    def copy(self, copies: list[tuple[int, int]]) -> None:
        for src, dst in copies:
            self.ex.copy_block(src, dst)
            if self.drafter is not None:
                self.drafter.copy_block(src, dst)


class _SchedulerRoom:
    """Drafted positions' room (``speculative.DraftRoom``): blocks from the
    scheduler, without preempting anyone, copied before the draft writes."""

    def __init__(self, scheduler: Scheduler, copier: BlockCopier) -> None:
        self.scheduler = scheduler
        self.copier = copier

    def make_room(self, seq: Sequence, n: int) -> int:
        k, copies = self.scheduler.reserve(seq, n)
        self.copier.copy(copies)
        return k

    def table(self, seq: Sequence) -> list[int]:
        return self.scheduler.table(seq)
