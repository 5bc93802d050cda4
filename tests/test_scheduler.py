"""The continuous-batching engine (runtime.engine), driven directly.

stories260K built for batched serving (f32 weights, so the single-stream
reference takes the same arithmetic): requests batched together give the
tokens each gives alone and the single-stream ``generate`` gives; a shared
prefix is prefilled once; a pool too small for everyone preempts and still
gives the same tokens; cancelling frees every block; one request may use
the whole context while others run; the queue is bounded; a drain cuts what
is left with a finish reason. With a model drafter (the model's first layers
on its own pool, or the q8 copy of stories260K on a pool of its own), the
same greedy tokens, drafted in batched calls; the draft's pool holds the
right rows through prefix sharing, copy on write and preemption.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

import runtime
from runtime.cli import DEFAULT_MODEL, DEFAULT_TOKENIZER
from runtime.engine import Engine, EngineBusy, EngineError, Event, Request, load_batch_model, share_rows
from runtime.sampling import SamplerConfig
from runtime.serve.metrics import ServerMetrics
from runtime.speculative import Speculation
from runtime.speculative.build import build_drafter
from shared_data import MODELS, needs_shared

CTX = 256
BS = 8


def batch_model(n_blocks: int | None = None, max_batch: int = 8):
    return load_batch_model(DEFAULT_MODEL, DEFAULT_TOKENIZER, ctx=CTX, threads=2,
                            batch=runtime.BatchOptions(block_size=BS, n_blocks=n_blocks, max_batch=max_batch))


@pytest.fixture(scope="module")
def single():
    return runtime.load(DEFAULT_MODEL, DEFAULT_TOKENIZER, ctx=CTX, threads=2)


@pytest.fixture(scope="module")
def pooled():
    return batch_model()


def engine_for(model, max_batch: int = 8, chunk: int = 16, **kw) -> Engine:
    return Engine(model, max_batch, prefill_chunk=chunk, metrics=ServerMetrics(), **kw)


class Collect:
    """A request's events, as the HTTP side would hear them."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.done = threading.Event()

    def __call__(self, ev: Event) -> None:
        self.events.append(ev)
        if ev.finish_reason is not None:
            self.done.set()

    @property
    def ids(self) -> list[int]:
        return [t for e in self.events for t in e.token_ids]

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events)

    @property
    def last(self) -> Event:
        return self.events[-1]


def request(ids: list[int], n: int, rid: str = "", **sampling) -> tuple[Request, Collect]:
    c = Collect()
    return Request(list(ids), n, SamplerConfig(**sampling), c, id=rid), c


def run_all(engine: Engine, reqs: list[Request], limit: int = 5000) -> None:
    """Drive the engine by hand until nothing is left."""
    for r in reqs:
        engine.submit(r)
    for _ in range(limit):
        engine.step()
        if not engine.running and not engine.waiting and engine.outstanding == 0:
            return
    raise AssertionError("the engine did not finish")


def prompts(model, n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    words = "Once upon a time there was a little girl named Lily who loved the big red ball".split()
    out = []
    for i in range(n):
        k = int(rng.integers(1, 40))
        out.append(model.tokenizer.encode(" ".join(rng.choice(words, k)), True))
    return out


def test_batched_equals_solo_and_single_stream(pooled, single):
    ps = prompts(single, 8)
    lengths = [40, 7, 23, 64, 1, 31, 50, 12]
    alone = []
    for p, n in zip(ps, lengths):
        r, c = request(p, n)
        run_all(engine_for(pooled), [r])
        alone.append(c.ids)
        assert c.ids == list(single.generate(p, n, temperature=0.0, stop=False))[: len(c.ids)]
    eng = engine_for(pooled)
    pairs = [request(p, n) for p, n in zip(ps, lengths)]
    run_all(eng, [r for r, _ in pairs])
    assert [c.ids for _, c in pairs] == alone
    # the steps really were batched: some decode steps advanced five or more
    # (the shortest requests are done before the last prompt is in)
    buckets = {s.labels["le"]: s.value for s in eng.metrics.batch_size.collect()[0].samples
               if s.name.endswith("_bucket")}
    assert buckets["4.0"] < buckets["+Inf"]
    for (_, c), n in zip(pairs, lengths):
        assert c.last.finish_reason in ("stop", "length")
        assert c.last.usage["completion_tokens"] == len(c.ids)
        if c.last.finish_reason == "length":
            assert len(c.ids) == n
    assert eng.blocks.used == 0


def test_steps_mix_decode_rows_and_prompt_chunks(pooled, monkeypatch):
    """With a model whose batch rows are its decode rows (``batch_sel``),
    a step is one native call: the generating rows and up to
    ``prefill_chunk`` prompt tokens of several prompts, logits only for the
    rows that need them. Same tokens as the two-call steps, in fewer steps."""
    assert pooled.executor.can_select
    ps = prompts(pooled, 8, seed=3)
    lengths = [30, 5, 17, 44, 9, 26, 12, 35]
    calls: list[tuple[int, int]] = []
    real = pooled.executor.batch

    def spy(tokens, positions, tables, last_only=False, decode=False, select=None):
        if select is not None:
            calls.append((len(tokens), len(select)))
        return real(tokens, positions, tables, last_only=last_only, decode=decode, select=select)

    monkeypatch.setattr(pooled.executor, "batch", spy)
    mixed = engine_for(pooled, chunk=24)
    pairs = [request(p, n) for p, n in zip(ps, lengths)]
    run_all(mixed, [r for r, _ in pairs])
    assert calls and max(t for t, _ in calls) > 24 and max(k for _, k in calls) > 1
    assert all(t <= 24 + 8 and k <= 8 for t, k in calls)
    monkeypatch.setattr(type(pooled.executor), "can_select", property(lambda self: False))
    calls.clear()
    split = engine_for(pooled, chunk=24)
    again = [request(p, n) for p, n in zip(ps, lengths)]
    run_all(split, [r for r, _ in again])
    assert not calls and [c.ids for _, c in again] == [c.ids for _, c in pairs]
    assert mixed.steps < split.steps
    assert mixed.blocks.used == split.blocks.used == 0


def test_prompt_lookup_keeps_greedy_output_and_drafts_in_the_step(pooled, single):
    """Requests with prompt lookup, alone and batched with plain ones: the
    same tokens as without it (each drafted token is kept only where the
    model's own choice agrees), and drafts really were checked and kept."""
    ps = prompts(single, 6, seed=3)
    ps[0] = single.tokenizer.encode("Lily had a red ball. Lily had a red ball. Lily had a red", True)
    lengths = [40, 30, 12, 50, 25, 33]
    plain = []
    for p, n in zip(ps, lengths):
        r, c = request(p, n)
        run_all(engine_for(pooled), [r])
        plain.append(c.ids)
    eng = engine_for(pooled)
    pairs = [request(p, n) for p, n in zip(ps, lengths)]
    for i, (r, _) in enumerate(pairs):
        r.lookup, r.draft_max = (2, 4) if i % 2 == 0 else (0, 8)
    run_all(eng, [r for r, _ in pairs])
    assert [c.ids for _, c in pairs] == plain
    drafted, kept = eng.metrics.draft_tokens._value.get(), eng.metrics.accepted_tokens._value.get()
    assert 0 < kept <= drafted, (kept, drafted)
    alone = engine_for(pooled)
    r, c = request(ps[0], 40)
    r.lookup = 3
    run_all(alone, [r])
    assert c.ids == plain[0] and alone.metrics.accepted_tokens._value.get() > 0
    # fewer steps than tokens: several tokens came out of one step
    assert alone.steps < len(c.ids) + 1
    for _, c in pairs:
        assert c.last.usage["completion_tokens"] == len(c.ids)
    sampled, cs = request(ps[0], 30, temperature=0.8, seed=5)
    sampled.lookup = 2
    run_all(alone, [sampled])
    assert cs.last.finish_reason in ("stop", "length") and cs.last.usage["completion_tokens"] == len(cs.ids)
    assert eng.blocks.used == 0 and alone.blocks.used == 0
    for n in (-1, 65):
        with pytest.raises(EngineError, match="draft_max"):
            bad, _ = request(ps[0], 4)
            bad.lookup, bad.draft_max = 2, n
            eng.submit(bad)
    # draft_max 0: no speculation for that request
    before = eng.metrics.draft_tokens._value.get()
    off, co = request(ps[0], 40)
    off.lookup, off.draft_max = 3, 0
    run_all(eng, [off])
    assert co.ids == plain[0] and eng.metrics.draft_tokens._value.get() == before


def test_shared_prefix_is_prefilled_once(pooled):
    eng = engine_for(pooled)
    system = pooled.tokenizer.encode("Lily and Tom went to the park. " * 6, True)
    assert len(system) >= 4 * BS
    tails = [pooled.tokenizer.encode(f" Then {w} came.", False) for w in ("Ben", "Sue", "a dog", "the sun")]
    first, c0 = request(system + tails[0], 4)
    run_all(eng, [first])
    rest = [request(system + t, 4) for t in tails[1:]]
    run_all(eng, [r for r, _ in rest])
    assert len(system) % BS, "the system prompt ends inside a block"
    for (r, c), t in zip(rest, tails[1:]):
        # its full blocks shared, and the block it ends in copied: all of it reused, and what
        # the tail has in common with the first request's, up to that block's end
        common = next(i for i, (x, y) in enumerate(zip(r.prompt_ids + [-1], first.prompt_ids)) if x != y)
        assert c.last.usage["cached_tokens"] == min(common, (len(system) // BS + 1) * BS - 1)
        assert c.last.usage["cached_tokens"] >= len(system)
    assert c0.last.usage["cached_tokens"] == 0
    ran = eng.metrics.prompt_tokens._value.get()
    assert ran == len(system) + len(tails[0]) + sum(len(r.prompt_ids) - c.last.usage["cached_tokens"]
                                                     for r, c in rest)
    # the same tokens as without sharing
    for (r, c) in rest:
        alone, ca = request(r.prompt_ids, 4)
        run_all(engine_for(batch_model()), [alone])
        assert ca.ids == c.ids


def test_a_shared_prefix_arriving_together_is_prefilled_once(pooled):
    """Four prompts with one system prompt, submitted at once: the first
    prefills it, the others wait for its blocks instead of computing them
    beside it, then share them; the tokens are a fresh engine's."""
    eng = engine_for(pooled)
    system = pooled.tokenizer.encode("Lily and Tom went to the park. " * 6, True)
    full = len(system) // BS * BS
    assert full >= 4 * BS
    tails = [pooled.tokenizer.encode(f" Then {w} came.", False) for w in ("Ben", "Sue", "a dog", "the sun")]
    pairs = [request(system + t, 4) for t in tails]
    run_all(eng, [r for r, _ in pairs])
    cached = [c.last.usage["cached_tokens"] for _, c in pairs]
    assert cached[0] == 0 and all(n >= full for n in cached[1:]), cached
    ran = eng.metrics.prompt_tokens._value.get()
    assert ran == sum(len(r.prompt_ids) for r, _ in pairs) - sum(cached)
    assert ran <= len(system) + sum(len(r.prompt_ids) - full for r, _ in pairs[1:])
    for r, c in pairs:
        alone, ca = request(r.prompt_ids, 4)
        run_all(engine_for(batch_model()), [alone])
        assert ca.ids == c.ids
    assert eng.blocks.used == 0


@pytest.mark.parametrize("mix", [True, False])
def test_every_prompt_token_is_counted_once(pooled, monkeypatch, mix):
    """A chunk that stops one short of the prompt's end leaves the last
    token to a decode row; it is still a prompt token run through the model
    (CI once saw the shared-prefix count short by one, this way)."""
    if not mix:
        monkeypatch.setattr(type(pooled.executor), "can_select", property(lambda self: False))
    eng = engine_for(pooled, chunk=16)
    p = prompts(pooled, 1)[0]
    ids = (p * 17)[:17]
    r, c = request(ids, 3)
    run_all(eng, [r])
    assert len(c.ids) == 3 and c.last.usage["cached_tokens"] == 0
    assert eng.metrics.prompt_tokens._value.get() == 17


def test_a_small_pool_preempts_and_gives_the_same_tokens(single):
    """Six sequences of up to 110 positions in a pool of 160: they cannot all
    grow at once; the youngest go back to the queue and are recomputed."""
    small = batch_model(n_blocks=160 // BS, max_batch=6)
    ps = prompts(single, 6, seed=3)
    eng = engine_for(small, max_batch=6)
    pairs = [request(p, 80) for p in ps]
    run_all(eng, [r for r, _ in pairs])
    assert eng.metrics.preemptions._value.get() > 0
    for p, (_, c) in zip(ps, pairs):
        want = list(single.generate(p, 80, temperature=0.0, stop=False))
        assert c.ids == want[: len(c.ids)]
        assert c.last.finish_reason == "length" or c.ids[-1] in small.config.stop_ids
    assert eng.blocks.used == 0


def test_cancel_frees_blocks(pooled):
    eng = engine_for(pooled)
    pairs = [request(p, 200, rid=f"r{i}") for i, p in enumerate(prompts(pooled, 4, seed=5))]
    for r, _ in pairs:
        eng.submit(r)
    for _ in range(12):
        eng.step()
    assert eng.blocks.used > 0
    for r, _ in pairs:
        eng.cancel(r.id)
    eng.step()
    assert not eng.running and not eng.waiting and eng.outstanding == 0
    assert eng.blocks.used == 0
    assert all(c.last.finish_reason is None for _, c in pairs)   # nobody listens any more
    r, c = request(prompts(pooled, 1)[0], 5)
    run_all(eng, [r])
    assert len(c.ids) == 5


def test_one_request_may_use_the_whole_context(single):
    """The pool holds one context and a little: a prompt of nearly the whole
    context runs to its end while short requests stream beside it."""
    model = batch_model(n_blocks=CTX // BS + 6, max_batch=4)
    eng = engine_for(model, max_batch=4)
    long_prompt = ([1] + [int(t) for t in np.random.default_rng(1).integers(3, 500, CTX - 40)])
    big, cb = request(long_prompt, 39)
    small = [request(p, 6) for p in prompts(single, 3, seed=9)]
    run_all(eng, [big] + [r for r, _ in small])
    assert len(cb.ids) == 39 or cb.ids[-1] in model.config.stop_ids
    assert cb.ids == list(single.generate(long_prompt, 39, temperature=0.0, stop=False))[: len(cb.ids)]
    for _, c in small:
        assert c.last.finish_reason is not None and c.ids


def test_checks_and_queue_bound(pooled):
    eng = engine_for(pooled, max_batch=2, max_queue=1)
    with pytest.raises(EngineError, match="context is 256"):
        eng.submit(request([1] * 200, 100)[0])
    with pytest.raises(EngineError, match="empty"):
        eng.submit(request([], 5)[0])
    with pytest.raises(EngineError, match="vocabulary"):
        eng.submit(request([1, 10 ** 6], 5)[0])
    for _ in range(3):
        eng.submit(request([1, 2], 5)[0])
    with pytest.raises(EngineBusy):
        eng.submit(request([1, 2], 5)[0])


def test_drain_cuts_what_is_left(pooled):
    eng = engine_for(pooled)
    pairs = [request(p, 200) for p in prompts(pooled, 3, seed=7)]
    for r, _ in pairs:
        eng.submit(r)
    for _ in range(5):
        eng.step()
    eng.drain(0.0)
    with pytest.raises(EngineBusy, match="shutting down"):
        eng.submit(request([1, 2], 5)[0])
    eng.step()
    for _, c in pairs:
        assert c.last.finish_reason == "length" and c.last.usage["completion_tokens"] == len(c.ids)
    assert eng.blocks.used == 0 and eng.outstanding == 0


def test_engine_thread_serves_requests(pooled):
    eng = engine_for(pooled).start()
    try:
        pairs = [request(p, 10) for p in prompts(pooled, 3, seed=11)]
        for r, _ in pairs:
            eng.submit(r)
        for _, c in pairs:
            assert c.done.wait(60)
            assert len(c.ids) == 10 or c.last.finish_reason == "stop"
    finally:
        eng.stop()


# --- model drafters ------------------------------------------------------------------------------
STORIES_Q8 = str(MODELS / "stories260K-q8.bin")
DRAFTERS = {
    "draft-layers-1": lambda: Speculation(draft_layers=1, draft_max=4),
    "draft-layers-4": lambda: Speculation(draft_layers=4, draft_max=4),
    "draft": lambda: Speculation(draft=STORIES_Q8, draft_tokenizer=str(DEFAULT_TOKENIZER), draft_max=4),
}


def drafting(name: str, n_blocks: int | None = None, max_batch: int = 8):
    """A model built for ``max_batch`` sequences plus 4 drafted rows, and its drafter."""
    model = batch_model(n_blocks, max_batch + 4)
    return model, build_drafter(model, DRAFTERS[name]())


def counts(eng: Engine) -> tuple[float, float]:
    return eng.metrics.draft_tokens._value.get(), eng.metrics.accepted_tokens._value.get()


def test_share_rows():
    assert share_rows([4, 4, 4], 8) == [3, 3, 2]
    assert share_rows([1, 6, 0, 6], 8) == [1, 4, 0, 3]
    assert share_rows([2, 2], 9) == [2, 2]
    assert share_rows([5, 5], 0) == [0, 0]


@needs_shared
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_model_drafters_keep_greedy_output_and_draft_in_batches(pooled, single, name):
    """Eight requests at once: the tokens of the engine without a drafter;
    drafts were made (a call drafts for several sequences at once) and
    checked: some accepted (nearly all from the q8 copy), and from the
    first layer alone some rejected."""
    ps = prompts(single, 8)
    lengths = [40, 7, 23, 64, 1, 31, 50, 12]
    plain = [request(p, n) for p, n in zip(ps, lengths)]
    run_all(engine_for(pooled), [r for r, _ in plain])
    model, drafter = drafting(name)
    calls: list[int] = []   # sequences of each call of the draft
    batch = drafter.executor.batch

    def counted(tokens, positions, tables, **kw):
        calls.append(len({tuple(t) for t in tables}))
        return batch(tokens, positions, tables, **kw)

    drafter.executor.batch = counted
    eng = engine_for(model, drafter=drafter)
    pairs = [request(p, n) for p, n in zip(ps, lengths)]
    run_all(eng, [r for r, _ in pairs])
    assert [c.ids for _, c in pairs] == [c.ids for _, c in plain]
    drafted, kept = counts(eng)
    assert drafted > 0 and max(calls) >= 2, (drafted, calls)
    if name == "draft-layers-1":
        assert kept < drafted
    else:
        assert kept > 0
    if name == "draft":   # the q8 copy drafts nearly always right: several tokens a step
        assert kept > 0.8 * drafted and eng.steps < sum(len(c.ids) for _, c in pairs) / 2
    for _, c in pairs:
        assert c.last.usage["completion_tokens"] == len(c.ids)
    assert eng.blocks.used == 0
    # draft_max 0: this request drafts nothing, the same tokens
    r, c = request(ps[3], lengths[3])
    r.draft_max = 0
    run_all(eng, [r])
    assert c.ids == plain[3][1].ids and counts(eng) == (drafted, kept)


def _draft_rows(drafter, table: list[int], n: int) -> np.ndarray:
    """The draft pool's K and V rows of positions 0..n-1 of a sequence (native executor)."""
    ex = drafter.executor
    bs = ex.block_size
    out = []
    # by name: a manifest read back from the cache lists its states in another order than a fresh one
    for name, nb in sorted(ex.manifest["batch"]["block_bytes"].items()):
        base, row = int(ex.manifest["state_offsets"][name]), nb // bs
        for p in range(n):
            at = base + table[p // bs] * nb + p % bs * row
            out.append(ex.state[at: at + row].view(np.float32))
    return np.stack(out)


def _step_until_generating(eng: Engine, seqs: int) -> None:
    for _ in range(100):
        eng.step()
        if len(eng.running) == seqs and all(s.generated for s in eng.running):
            return
    raise AssertionError("the prompts did not run")


@needs_shared
def test_a_draft_models_pool_follows_shared_and_copied_blocks(single):
    """A prompt of whole blocks seen before shares them all and rewrites
    its last position (copy on write); a longer one shares them and
    prefills the rest: the draft's rows of every position are those a
    fresh engine computes, the outputs those of plain decoding."""
    model, drafter = drafting("draft")
    eng = engine_for(model, drafter=drafter)
    prompt = model.tokenizer.encode("Lily and Tom went to the park. " * 6, True)[: 9 * BS]
    longer = prompt + model.tokenizer.encode(" Then Ben came.", False)
    first, _ = request(prompt, 30)
    run_all(eng, [first])
    again, ca = request(prompt, 30)
    more, cm = request(longer, 30)
    for r in (again, more):
        eng.submit(r)
    _step_until_generating(eng, 2)
    got = [_draft_rows(drafter, eng.blocks.table(s.key), len(s.req.prompt_ids))
           for r in (again, more) for s in eng.running if s.req is r]
    run_all(eng, [])
    assert ca.last.usage["cached_tokens"] == len(prompt) - 1 and cm.last.usage["cached_tokens"] == len(prompt)
    for r, c, rows in zip((again, more), (ca, cm), got):
        assert c.ids == list(single.generate(r.prompt_ids, 30, temperature=0.0, stop=False))[: len(c.ids)]
        fresh_model, fresh = drafting("draft")
        alone = engine_for(fresh_model, drafter=fresh)
        alone.submit(request(r.prompt_ids, 30)[0])
        _step_until_generating(alone, 1)
        want = _draft_rows(fresh, alone.blocks.table(alone.running[0].key), len(r.prompt_ids))
        np.testing.assert_allclose(rows, want, rtol=1e-5, atol=1e-6)
    drafted, kept = counts(eng)
    assert kept > 0.9 * drafted


@needs_shared
@pytest.mark.parametrize("name", ["draft", "draft-layers-4"])
def test_model_drafters_with_a_small_pool_preempt_and_give_the_same_tokens(single, name):
    model, drafter = drafting(name, n_blocks=160 // BS, max_batch=6)
    ps = prompts(single, 6, seed=3)
    eng = engine_for(model, max_batch=6, drafter=drafter)
    pairs = [request(p, 80) for p in ps]
    run_all(eng, [r for r, _ in pairs])
    assert eng.metrics.preemptions._value.get() > 0 and counts(eng)[1] > 0
    for p, (_, c) in zip(ps, pairs):
        assert c.ids == list(single.generate(p, 80, temperature=0.0, stop=False))[: len(c.ids)]
    assert eng.blocks.used == 0


@needs_shared
def test_sampling_with_a_model_drafter(single):
    """Temperature 0.8: drafts drawn from the draft's distribution and
    checked by the rejection rule (its distribution is test_speculative's);
    the replies are whole."""
    model, drafter = drafting("draft")
    eng = engine_for(model, drafter=drafter)
    pairs = [request(p, 40, temperature=0.8, seed=i) for i, p in enumerate(prompts(single, 4, seed=2))]
    run_all(eng, [r for r, _ in pairs])
    drafted, kept = counts(eng)
    assert 0 < kept <= drafted
    for _, c in pairs:
        assert c.last.finish_reason in ("stop", "length") and c.last.usage["completion_tokens"] == len(c.ids)
        assert all(0 <= t < single.config.vocab_size for t in c.ids)
    assert eng.blocks.used == 0


@needs_shared
@pytest.mark.parametrize("name", ["draft", "draft-layers-1"])
def test_model_drafters_on_the_interpreter(name):
    """The interpreter's paged steps take the same drafters (the reference
    backend): the same greedy tokens as without them, drafts checked."""
    def interp(max_batch: int):
        return load_batch_model(DEFAULT_MODEL, DEFAULT_TOKENIZER, ctx=CTX, backend="interp",
                                batch=runtime.BatchOptions(block_size=BS, max_batch=max_batch))

    plain_model = interp(4)
    ps = prompts(plain_model, 3, seed=4)
    plain = [request(p, 20) for p in ps]
    run_all(engine_for(plain_model, max_batch=3), [r for r, _ in plain])
    model = interp(3 + 4)
    eng = engine_for(model, max_batch=3, drafter=build_drafter(model, DRAFTERS[name]()))
    pairs = [request(p, 20) for p in ps]
    run_all(eng, [r for r, _ in pairs])
    assert [c.ids for _, c in pairs] == [c.ids for _, c in plain]
    assert counts(eng)[0] > 0 and eng.blocks.used == 0
