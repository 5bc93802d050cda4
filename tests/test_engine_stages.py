"""The engine's stages on their own, without a model or a thread: the
scheduler's plan is a function of its queue, its running sequences and the
block manager (``runtime.engine.scheduler``); the output stage turns tokens
into events, holding back stop strings (``runtime.engine.output``)."""
from __future__ import annotations

import numpy as np

from runtime.engine.block_manager import BlockManager
from runtime.engine.output import OutputProcessor
from runtime.engine.plan import SeqUpdate
from runtime.engine.requests import Request
from runtime.engine.scheduler import Scheduler, SchedulerLimits
from runtime.engine.sequence import Sequence
from runtime.sampling import Sampler, SamplerConfig

BS = 4


def seq(prompt: list[int], max_tokens: int = 8, **req) -> Sequence:
    return Sequence(Request(list(prompt), max_tokens, SamplerConfig(), lambda ev: None, **req),
                    Sampler(SamplerConfig(), 100))


def scheduler(n_blocks: int = 32, chunk: int = 8, max_batch: int = 4, can_select: bool = False) -> Scheduler:
    return Scheduler(BlockManager(n_blocks, BS), SchedulerLimits(max_batch=max_batch, prefill_chunk=chunk,
                                                                 max_rows=chunk + max_batch,
                                                                 max_decode_rows=max_batch, ctx=64,
                                                                 can_select=can_select))


def finish_chunks(sch: Scheduler, plan, token: int = 7) -> None:
    """What the core would do: each chunk's rows are in the pool, a finished prompt samples ``token``."""
    for c in plan.chunks:
        sch.update(SeqUpdate(c.seq, c.positions.stop, c.seq.tokens, [token] if c.finishes else []))


def test_prompts_are_chunked_oldest_first_then_decoded():
    sch = scheduler()
    a, b = seq(range(1, 11)), seq(range(20, 26))
    sch.add(a)
    sch.add(b)
    plan = sch.schedule()
    # both admitted; without row selection one prompt's chunk a step, the oldest first
    assert sch.running == [a, b] and not sch.waiting
    assert not plan.mixed and not plan.decode and plan.draft_ns == []
    assert [(c.seq, c.positions) for c in plan.chunks] == [(a, range(0, 8))]
    finish_chunks(sch, plan)
    plan = sch.schedule()
    assert [(c.seq, c.positions) for c in plan.chunks] == [(a, range(8, 10))] and plan.chunks[0].finishes
    finish_chunks(sch, plan)
    plan = sch.schedule()
    assert plan.decode == [a] and [(c.seq, c.positions) for c in plan.chunks] == [(b, range(0, 6))]
    assert plan.draft_ns == [0]
    assert a.tokens[-1] == 7 and a.generated == 1 and a.computed == 10


def test_with_row_selection_a_step_mixes_decode_rows_and_chunks():
    sch = scheduler(can_select=True)
    a, b, c = seq(range(1, 6)), seq(range(10, 17)), seq(range(30, 40))
    for s in (a, b, c):
        sch.add(s)
    plan = sch.schedule()
    assert plan.mixed and [(x.seq, x.positions) for x in plan.chunks] == [(a, range(0, 5)), (b, range(0, 3))]
    finish_chunks(sch, plan)
    plan = sch.schedule()
    # a generates; the budget of 8 prompt tokens goes on to b's rest and c's start
    assert plan.decode == [a] and plan.mixed
    assert [(x.seq, x.positions) for x in plan.chunks] == [(b, range(3, 7)), (c, range(0, 4))]


def test_the_plan_is_a_function_of_its_inputs():
    plans = []
    for _ in range(2):
        sch = scheduler(can_select=True)
        for p in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9], [8] * 13):
            sch.add(seq(p))
        plan = sch.schedule()
        plans.append([(c.seq.tokens, c.positions) for c in plan.chunks] + [plan.copies, plan.mixed])
    assert plans[0] == plans[1]


def test_a_prompt_waits_for_a_shared_prefix_being_prefilled():
    sch = scheduler(chunk=4)
    system = list(range(1, 13))                 # three full blocks
    a, b = seq(system + [40, 41]), seq(system + [50])
    sch.add(a)
    sch.add(b)
    plan = sch.schedule()
    assert sch.running == [a] and list(sch.waiting) == [b]   # b waits for a's blocks
    while any(c.seq is a for c in plan.chunks) and a.computed < 12:
        finish_chunks(sch, plan)
        plan = sch.schedule()
    assert b in sch.running
    assert b.cached_prompt == 12 and plan.cached_prompt_tokens == 12   # then shares them all


def test_a_full_pool_preempts_the_youngest():
    sch = scheduler(n_blocks=4, chunk=16)
    a, b = seq(range(1, 8), max_tokens=20), seq(range(10, 17), max_tokens=20)
    sch.add(a)
    sch.add(b)
    plan = sch.schedule()
    assert sch.running == [a, b]             # two blocks each
    finish_chunks(sch, plan)
    plan = sch.schedule()
    finish_chunks(sch, plan)
    for s in (a,):                           # a grows into a third block: b must make room
        sch.update(SeqUpdate(s, len(s.tokens), s.tokens, [7]))
    plan = sch.schedule()
    assert plan.preemptions == 1 and sch.running == [a] and list(sch.waiting) == [b] and b.computed == 0
    assert plan.decode == [a]


def test_reserve_never_preempts():
    sch = scheduler(n_blocks=3, chunk=16)
    a = seq(range(1, 8))
    sch.add(a)
    finish_chunks(sch, sch.schedule())
    # 8 tokens in two blocks; room for drafts up to the pool's third block and no further
    assert sch.reserve(a, 8) == (4, [])
    assert sch.running == [a]


# --- the output stage ------------------------------------------------------------------------
class Pieces:
    """A tokenizer whose token i is the text ``pieces[i]``."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def stream_decoder(self):
        pieces = self.pieces

        class Decoder:
            def feed(self, prev, tok):
                return pieces[tok]

            def flush(self):
                return ""

        return Decoder()


PIECES = Pieces(["<s>", "</s>", "ab", "c ", "xy", "z", "d"])
EOS = 1


def output(s: Sequence, ctx: int = 64) -> OutputProcessor:
    out = OutputProcessor(PIECES, [EOS], ctx)
    out.add(s)
    return out


def rows(n: int) -> list[np.ndarray]:
    return [np.zeros(7, np.float32)] * n


def test_a_stop_string_across_tokens_is_never_shown():
    s = seq([0], max_tokens=10, stop=["c x"])
    em = output(s).process(s, [2, 3, 4, 5], rows(4))
    assert em.kept == 3 and em.finish == "stop"
    assert [e.text for e in em.events] == ["ab", "", ""]
    assert em.events[-1].finish_reason == "stop" and em.events[-1].usage["completion_tokens"] == 3
    assert all(e.finish_reason is None for e in em.events[:-1])


def test_held_back_text_shows_at_an_end_of_generation_token():
    s = seq([0], max_tokens=10, stop=["c x"])
    out = output(s)
    em = out.process(s, [2, 3], rows(2))
    assert [e.text for e in em.events] == ["ab", ""] and em.finish is None
    s.tokens += [2, 3]
    s.generated += 2
    em = out.process(s, [EOS, 6], rows(2))      # a drafted token after the end is not kept
    assert em.kept == 1 and em.finish == "stop" and em.events[0].text == "c "
    assert em.events[0].usage == {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4, "cached_tokens": 0}


def test_length_ignore_eos_and_logprobs():
    s = seq([0], max_tokens=2, ignore_eos=True, logprobs=2)
    logits = np.log(np.array([0.1, 0.6, 0.1, 0.1, 0.05, 0.03, 0.02], np.float32))
    em = output(s).process(s, [EOS, 6, 6], [logits] * 3)
    assert em.kept == 2 and em.finish == "length"
    assert [e.text for e in em.events] == ["</s>", "d"]
    lp = em.events[0].logprobs[0]
    assert lp.token == EOS and abs(lp.logprob - np.log(0.6)) < 1e-5 and [t for t, _ in lp.top] == [1, 0]
    s2 = seq([0, 2, 2], max_tokens=50)
    em = output(s2, ctx=5).process(s2, [6, 6, 6], rows(3))   # the context ends it
    assert em.kept == 2 and em.finish == "length"
