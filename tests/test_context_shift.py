"""Context shift (``runtime.context_shift``, issue 34 item 4): past the
context, the first ``keep`` tokens stay, the oldest half of the rest goes,
and generation goes on from the kept tokens recomputed at their new
positions.

The exactness check: greedy, the tokens after a shift are those a fresh run
on the kept tokens gives, id for id. Then: the kept prefix really is the
first tokens; a chat goes on across turns past the context and its cache
stays the session's ids; the batch engine shifts as the single stream does;
a real ``lmc serve --context-shift`` answers a conversation longer than its
context through the ``openai`` client and says so in ``usage``; without the
flag nothing changes (``length``, the old refusals).
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from itertools import pairwise

import openai
import pytest
from serve_process import ROOT, serve
from shared_data import SMOLLM2, instruct_models

import runtime
from runtime.chat import ChatSession, ChatSettings
from runtime.cli import DEFAULT_MODEL, DEFAULT_TOKENIZER
from runtime.context_shift import chat_keep, shift_tokens
from runtime.engine import EngineError, Request, load_batch_model
from runtime.errors import RunError
from runtime.sampling import SamplerConfig
from runtime.serve.metrics import ServerMetrics
from runtime.speculative import Speculation

CTX = 128
PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
SYSTEM = "Always answer in French."


@pytest.fixture(scope="module")
def smollm2() -> str:
    return instruct_models()[SMOLLM2]


@pytest.fixture(scope="module")
def shifting(smollm2):
    return runtime.load(smollm2, ctx=CTX, threads=2, context_shift=True)


@pytest.fixture(scope="module")
def plain(smollm2):
    return runtime.load(smollm2, ctx=CTX, threads=2)


# --- the arithmetic ------------------------------------------------------------------------------

def test_shift_keeps_the_first_tokens_and_drops_the_oldest_half_of_the_rest():
    ids = list(range(129))
    kept, dropped = shift_tokens(ids, 10, 127)
    assert dropped == (129 - 10) // 2 == 59
    assert kept == list(range(10)) + list(range(69, 129))
    assert shift_tokens(ids, 10, 200) == (ids, 0)           # it fits: unchanged
    long, n = shift_tokens(list(range(1000)), 4, 100)          # halved as often as it takes
    assert len(long) <= 100 and long[:4] == [0, 1, 2, 3] and long[-1] == 999 and n == 1000 - len(long)
    assert long[4:] == list(range(1000 - len(long) + 4, 1000))
    with pytest.raises(RunError, match="--keep"):
        shift_tokens(ids, 127, 127)


# --- one stream ----------------------------------------------------------------------------------

def _segments(prompt: list[int], out: list[int], keep: int, ctx: int):
    """Replay the shifts of a generation: for each, the kept tokens and the
    tokens generated from them until the next shift."""
    hist, i, segs = list(prompt), 0, []
    while True:
        room = ctx + 1 - len(hist)       # the stream shifts when it holds ctx tokens and a pending one
        if i + room > len(out):
            return segs
        hist = hist + out[i:i + room]
        i += room
        hist, _ = shift_tokens(hist, keep, ctx - 1)
        nxt = min(len(out) - i, ctx + 1 - len(hist))
        segs.append((list(hist), out[i:i + nxt]))


@pytest.mark.parametrize("keep", [0, 12])
def test_tokens_after_a_shift_equal_a_fresh_run_on_the_kept_tokens(shifting, plain, keep):
    prompt = shifting.encode(PROMPT)
    out = list(shifting.generate(prompt, 260, stop=False, keep=keep, repeat_penalty=1.3))
    comp, extra = shifting.last_completion, shifting.last_stats.extra
    assert len(out) == 260 and comp.stop_reason == "length"
    segs = _segments(prompt, out, keep, CTX)
    assert extra["context_shifts"] == len(segs) >= 2 and extra["keep"] == keep
    assert extra["shifted_tokens"] == len(prompt) + 260 - len(comp.context_ids)
    for kept, after in segs:
        assert kept[:keep] == prompt[:keep]                   # the kept prefix is the first tokens
        assert len(after) > 10
        fresh = list(plain.generate(kept, len(after), stop=False, repeat_penalty=1.3))
        assert fresh == after                                 # recompute is exact
    assert comp.context_ids[:keep] == prompt[:keep] and len(comp.context_ids) <= CTX + 1


def test_without_the_flag_generation_ends_at_the_context(plain):
    prompt = plain.encode(PROMPT)
    out = list(plain.generate(prompt, 500, stop=False))
    assert len(out) == CTX - len(prompt) + 1 and plain.last_completion.stop_reason == "length"
    assert "context_shifts" not in plain.last_stats.extra
    with pytest.raises(RunError, match="longer than the context"):
        list(plain.generate(list(range(1, CTX + 10)), 4))


def test_a_prompt_longer_than_the_context_is_shifted_to_fit(shifting):
    prompt = shifting.encode(" ".join([PROMPT] * 12))
    assert len(prompt) > CTX
    out = list(shifting.generate(prompt, 8, stop=False, keep=5))
    comp = shifting.last_completion
    assert len(out) == 8 and comp.prompt_ids[:5] == prompt[:5] and comp.prompt_ids[-20:] == prompt[-20:]
    assert len(comp.prompt_ids) <= CTX
    assert shifting.last_stats.extra["shifted_tokens"] >= len(prompt) - CTX


def test_speculative_decoding_shifts_as_plain_decoding_does(smollm2, shifting):
    spec = runtime.load(smollm2, ctx=CTX, threads=2, context_shift=True, speculation=Speculation(lookup=2))
    prompt = shifting.encode(PROMPT)
    want = list(shifting.generate(prompt, 220, stop=False, keep=8))
    got = list(spec.generate(prompt, 220, stop=False, keep=8))
    assert got == want
    assert spec.last_stats.extra["context_shifts"] == shifting.last_stats.extra["context_shifts"] >= 1


def test_keep_must_leave_room(smollm2):
    with pytest.raises(RunError, match="keep"):
        runtime.load(smollm2, ctx=CTX, threads=2, context_shift=True, keep=CTX - 1)


# --- chat ------------------------------------------------------------------------------------------

def test_a_chat_goes_on_past_the_context_keeping_the_system_prompt(shifting):
    s = ChatSession(shifting, SYSTEM, ChatSettings(max_new_tokens=90, sampling={"temperature": 0.0,
                                                                                 "repeat_penalty": 1.3}))
    keep = chat_keep(shifting.tokenizer, s.messages)
    system_ids = shifting.tokenizer.chat_ids([{"role": "system", "content": SYSTEM}], False)
    first = shifting.tokenizer.chat_ids(s.messages + [{"role": "user", "content": "a"}], True)
    # the whole system turn and the user turn's opening (a one-letter message once put it out of reach)
    assert first[:len(system_ids)] == system_ids and keep == len(system_ids) + 3
    questions = ["Tell me about the sea.", "And about boats?", "What do fishermen eat?", "Name three fish.",
                 "Where is Brittany?"]
    for q in questions:
        reply = "".join(s.send(q))
        assert reply
        # what the cache holds is the session's ids (all but the last token's row), the system prompt first
        assert shifting._kv == s._ids[:len(shifting._kv)] and len(s._ids) <= CTX + 1
        assert s._ids[:keep] == shifting.tokenizer.chat_ids(s.messages[:2], True)[:keep]
    turns = s.turns
    assert sum(t.context_shifts for t in turns) >= 2
    assert all(t.dropped_messages == 0 for t in turns)
    assert len(s.messages) == 1 + 2 * len(questions)           # every message stays; tokens went instead
    # a turn after a shift still starts from the cache: more than the kept tokens are reused
    after = [t for prev, t in pairwise(turns) if prev.context_shifts]
    assert after and all(t.cached_tokens > keep for t in after if not t.context_shifts)


def _lmc(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runtime.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          input=stdin, timeout=600, check=False)


def test_lmc_chat_json_reports_the_shift(smollm2, tmp_path):
    msgs = tmp_path / "m.json"
    msgs.write_text(json.dumps([{"role": "system", "content": SYSTEM},
                                {"role": "user", "content": "Tell me a long story about the sea."}]))
    r = _lmc("chat", smollm2, "-c", str(CTX), "-t", "2", "--context-shift", "--messages", str(msgs), "--json",
             "--temp", "0", "--repeat-penalty", "1.3", "-n", "200")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    st = out["stats"]
    # it went on past the context (until its end of turn, or -n)
    assert len(out["prompt_ids"]) + len(out["generated_ids"]) > CTX + 1
    assert st["context_shifts"] >= 1 and st["shifted_tokens"] > 0 and st["keep"] > 0
    messages = json.loads(msgs.read_text())
    assert st["keep"] == chat_keep(runtime.load_tokenizer(smollm2), messages)   # the system prompt's by default
    plain = _lmc("chat", smollm2, "-c", str(CTX), "-t", "2", "--messages", str(msgs), "--json", "--temp", "0",
                 "-n", "200")
    assert plain.returncode == 0, plain.stderr
    p = json.loads(plain.stdout)
    assert p["stop_reason"] == "length" and len(p["generated_ids"]) < 200 and "context_shifts" not in p["stats"]


@pytest.mark.parametrize("args, msg", [(["--keep", "3"], "--keep goes with --context-shift"),
                                       (["--context-shift", "--keep", str(CTX)], f"--keep {CTX}: must be smaller")])
def test_bad_keep_is_one_line_and_exit_2(smollm2, args, msg):
    r = _lmc("chat", smollm2, "-c", str(CTX), *args, stdin="")
    assert r.returncode == 2 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1


# --- the batch engine --------------------------------------------------------------------------------

class _Collect:
    def __init__(self) -> None:
        self.events = []
        self.done = threading.Event()

    def __call__(self, ev) -> None:
        self.events.append(ev)

    @property
    def ids(self) -> list[int]:
        return [t for e in self.events for t in e.token_ids]


def _run(engine, reqs) -> None:
    for r in reqs:
        engine.submit(r)
    for _ in range(20000):
        engine.step()
        if not engine.running and not engine.waiting and engine.outstanding == 0:
            return
    raise AssertionError("the engine did not finish")


def test_the_engine_shifts_as_the_single_stream_does():
    from runtime.engine import Engine

    ctx = 64
    single = runtime.load(DEFAULT_MODEL, DEFAULT_TOKENIZER, ctx=ctx, threads=2, context_shift=True)
    pooled = load_batch_model(DEFAULT_MODEL, DEFAULT_TOKENIZER, ctx=ctx, threads=2,
                              batch=runtime.BatchOptions(block_size=8, max_batch=4))
    prompts = [single.encode("Once upon a time there was a little girl named Lily"), single.encode("The cat")]
    keeps, ns = [5, 0], [200, 150]
    want = [list(single.generate(p, n, stop=False, keep=k)) for p, n, k in zip(prompts, ns, keeps)]
    metrics = ServerMetrics()
    engine = Engine(pooled, 4, prefill_chunk=16, metrics=metrics, context_shift=True)
    cs = [_Collect() for _ in range(3)]
    reqs = [Request(list(p), n, SamplerConfig(temperature=0.0), c, id=str(i), ignore_eos=True, keep=k, draft_max=0)
            for i, (p, n, k, c) in enumerate(zip(prompts, ns, keeps, cs))]
    # and one that drafts (prompt lookup): its drafts stop at the context, the shift follows
    reqs.append(Request(list(prompts[0]), ns[0], SamplerConfig(temperature=0.0), cs[2], id="2", ignore_eos=True,
                        keep=keeps[0], lookup=2, draft_max=4))
    _run(engine, reqs)
    for c, w, n in zip(cs, [*want, want[0]], [*ns, ns[0]]):
        last = c.events[-1]
        assert c.ids == w and last.finish_reason == "length" and last.usage["completion_tokens"] == n
        assert last.usage["context_shifts"] >= 2 and last.usage["shifted_tokens"] > 0
    assert b"lmc_context_shifts_total" in metrics.text()

    # without the flag: ends at the context (length) and refuses what cannot fit, as before
    engine = Engine(pooled, 4, prefill_chunk=16)
    c = _Collect()
    with pytest.raises(EngineError, match="context"):
        engine.submit(Request(list(prompts[0]), 200, SamplerConfig(temperature=0.0), c))
    _run(engine, [Request(list(prompts[0]), ctx - len(prompts[0]), SamplerConfig(temperature=0.0), c,
                          ignore_eos=True)])
    assert c.events[-1].finish_reason == "length" and "context_shifts" not in c.events[-1].usage
    assert len(prompts[0]) + len(c.ids) == ctx


# --- lmc serve ---------------------------------------------------------------------------------------

def test_lmc_serve_with_context_shift_answers_a_conversation_longer_than_its_context(smollm2):
    with serve(smollm2, "-t", "2", "-c", str(CTX), "--parallel", "2", "--context-shift") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600)
        model = SMOLLM2.rsplit(".", 1)[0]
        conversation = [{"role": "system", "content": SYSTEM}]
        for q in ["Tell me about the sea.", "And about boats?", "What do fishermen eat?", "Name a fish."]:
            conversation.append({"role": "user", "content": q})
            r = client.chat.completions.create(model=model, messages=conversation, max_tokens=100, temperature=0)
            conversation.append({"role": "assistant", "content": r.choices[0].message.content})
            assert r.choices[0].message.content
        conversation.append({"role": "user", "content": "Thank you. " + PROMPT})
        r = client.chat.completions.create(model=model, messages=conversation, max_tokens=60, temperature=0)
        u = r.usage
        assert u.prompt_tokens > CTX            # the conversation is longer than the context: shifted to fit
        assert u.model_extra["context_shifts"] >= 1 and u.model_extra["shifted_tokens"] > 0
        assert r.choices[0].message.content
        # a reply past the context goes on to max_tokens, streamed, and usage says it shifted
        stream = client.chat.completions.create(model=model, messages=conversation[:2], max_tokens=250,
                                                temperature=0, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
        assert text and usage.completion_tokens == 250
        assert usage.model_extra["context_shifts"] >= 1
        # a completion with n_keep: the first tokens stay
        r = client.completions.create(model=model, prompt=PROMPT, max_tokens=200, temperature=0,
                                      extra_body={"n_keep": 4})
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 200
        assert r.usage.model_extra["context_shifts"] >= 1


# --- rotation (llama.cpp's way), measured against recompute ------------------------------------------

@pytest.mark.parametrize("kv, tol", [("f32", 1e-4), ("f16", 2e-3)])
def test_rotated_rows_are_the_recomputed_ones_in_the_first_layer(smollm2, kv, tol):
    """Rotation moves rows and turns keys: in the first layer, where a row
    depends on its token and position alone, it gives the recompute's rows
    (keys to rounding, values exactly); above it, rows keep what the dropped
    tokens added, which is why recompute is the default."""
    import numpy as np

    from runtime.kv_rotate import KVRotator

    a = runtime.load(smollm2, ctx=CTX, threads=2, kv_type=kv)
    b = runtime.load(smollm2, ctx=CTX, threads=2, kv_type=kv)
    hist = a.encode(" ".join([PROMPT] * 8))[:CTX + 1]
    keep = 9
    kept, n = shift_tokens(hist, keep, CTX - 1)
    a.executor.prefill(hist[:CTX], 0)
    rot = KVRotator.of(a)
    rot.shift(keep, n, CTX)
    b.executor.prefill(kept, 0)
    rows = {}
    for r in rot.rows:
        va, vb = (np.ndarray((CTX, r.width), r.dtype, buffer=m.executor.state, offset=r.offset)[:len(kept) - 1]
                  .astype(np.float32) for m in (a, b))
        rows[r.name] = float(np.abs(va - vb).max() / np.abs(vb).max())
    assert rows["k_cache.0"] < tol and rows["v_cache.0"] == 0.0
    assert rows["k_cache.0"] > 0 or kv == "f32"       # f16 rounds once more
    assert max(rows.values()) > 100 * tol               # deeper layers differ: rotation is not exact


def test_rotate_mode_generates_and_falls_back_to_recompute_where_it_cannot(smollm2, shifting):
    prompt = shifting.encode(PROMPT)
    want = list(shifting.generate(prompt, 160, stop=False, keep=8))
    first_shift = CTX + 1 - len(prompt)
    rot = runtime.load(smollm2, ctx=CTX, threads=2, context_shift="rotate")
    got = list(rot.generate(prompt, 160, stop=False, keep=8))
    assert len(got) == 160 and rot.last_stats.extra["shift_by"] == "rotate"
    assert got[:first_shift] == want[:first_shift]
    assert rot.last_stats.extra["context_shifts"] == shifting.last_stats.extra["context_shifts"]
    q8 = runtime.load(smollm2, ctx=CTX, threads=2, context_shift="rotate", kv_type="q8")
    exact = runtime.load(smollm2, ctx=CTX, threads=2, context_shift=True, kv_type="q8")
    assert list(q8.generate(prompt, 160, stop=False, keep=8)) == list(exact.generate(prompt, 160, stop=False,
                                                                                      keep=8))
    assert q8.last_stats.extra["shift_by"].startswith("recompute (rotation needs an f32 or f16 cache")
