"""``lmc serve`` with a real instruct model (SmolLM2-135M-Instruct, from
../shared's fetch_model.py), through the official ``openai`` client.

The acceptance of the serve issue: chat streamed and whole and a
completion, greedy text equal to ``lmc chat``'s, usage equal to the
tokenizer's counts; 8 concurrent requests each equal to the same request
alone; a 3,500-token prompt beside 7 short streams with ``-c 4096
--parallel 8``; a 1,000-token system prompt shared by 8 requests and
prefilled once; a full server answering 503 and a drain that cuts a long
stream with its finish reason.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

import runtime
from serve_process import ROOT, serve, stream_into
from shared_data import SMOLLM2, instruct_models
from test_serve import metric

PARALLEL = 8


@pytest.fixture(scope="module")
def smollm2() -> str:
    return instruct_models()[SMOLLM2]


@pytest.fixture(scope="module")
def server(smollm2):
    with serve(smollm2, "-t", "2", "-c", "4096", "--parallel", str(PARALLEL)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return runtime.load_tokenizer(smollm2)


MODEL_ID = SMOLLM2.rsplit(".", 1)[0]
CONVERSATION = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "I have a dog called Rex."},
                {"role": "assistant", "content": "That's a great name for a dog!"},
                {"role": "user", "content": "Write two sentences about dogs."}]


def chat(client, messages, n: int, **kw):
    return client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=n, temperature=0, **kw)


def test_chat_whole_streamed_and_equal_to_lmc_chat(server, client, smollm2, tokenizer, tmp_path):
    whole = chat(client, CONVERSATION, 48)
    text = whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant" and len(text) > 20
    prompt_ids = tokenizer.chat_ids(CONVERSATION, True)
    assert whole.usage.prompt_tokens == len(prompt_ids)
    streamed, reasons, usage = [], [], None
    for chunk in chat(client, CONVERSATION, 48, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            streamed.append(c.delta.content or "")
            reasons.append(c.finish_reason)
    assert "".join(streamed) == text and len(streamed) > 10
    assert reasons[-1] == whole.choices[0].finish_reason
    assert usage.prompt_tokens == whole.usage.prompt_tokens and usage.completion_tokens == whole.usage.completion_tokens
    # lmc chat answers the same conversation with the same greedy text
    (tmp_path / "conv.json").write_text(json.dumps(CONVERSATION))
    r = subprocess.run([sys.executable, "-m", "runtime.cli", "chat", smollm2, "--messages", str(tmp_path / "conv.json"),
                        "--temp", "0", "-n", "48", "-t", "2", "-c", "4096", "--json"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    ref = json.loads(r.stdout)
    assert ref["prompt_ids"] == prompt_ids
    assert ref["text"] == text
    assert whole.usage.completion_tokens == len(ref["generated_ids"])
    assert whole.choices[0].finish_reason == {"eos": "stop", "length": "length", "stop": "stop"}[ref["stop_reason"]]


def test_completion(server, client, tokenizer):
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=12, temperature=0)
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt, True))
    assert r.usage.completion_tokens == 12 or r.choices[0].finish_reason == "stop"
    assert "Paris" in r.choices[0].text


PROMPTS = ["Name three colors.", "What is 2 + 2?", "Write a haiku about the sea.", "Say hello in French.",
           "List four animals that live in water, one per line.", "What is the opposite of hot?",
           "Give me a short tip for learning to code.", "Translate 'good morning' into Spanish."]
LENGTHS = [20, 9, 40, 14, 33, 6, 48, 25]


def test_batched_equals_solo(server, client):
    msgs = [[{"role": "user", "content": p}] for p in PROMPTS]
    alone = [chat(client, m, n).choices[0].message.content for m, n in zip(msgs, LENGTHS)]
    got: list[str | None] = [None] * len(msgs)
    before = metric(server.url, "lmc_batch_size_sum")

    def one(i: int) -> None:
        got[i] = chat(client, msgs[i], LENGTHS[i]).choices[0].message.content

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(msgs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert got == alone
    # they ran together: the decode steps advanced more than one sequence on average
    steps = metric(server.url, "lmc_batch_size_count")
    assert metric(server.url, "lmc_batch_size_sum") - before > 0 and steps > 0


def test_context_is_not_split(server, client, tokenizer):
    """-c 4096 --parallel 8: one 3,500-token prompt runs to its answer while
    seven short requests stream beside it."""
    words = " ".join(f"item{i}" for i in range(4000))
    ids = tokenizer.encode(words, False)[:3450]
    long_text = tokenizer.decode(ids)
    long_msgs = [{"role": "user", "content": long_text + "\nHow many items are listed?"}]
    n_long = len(tokenizer.chat_ids(long_msgs, True))
    assert 3450 < n_long < 4096 - 16
    done: dict[str, float] = {}
    first_token: dict[int, float] = {}
    results: dict = {}

    def long_request() -> None:
        results["long"] = chat(client, long_msgs, 16)
        done["long"] = time.monotonic()

    def short(i: int) -> None:
        for chunk in chat(client, [{"role": "user", "content": PROMPTS[i]}], 40, stream=True):
            if chunk.choices and chunk.choices[0].delta.content and i not in first_token:
                first_token[i] = time.monotonic()
        done[f"s{i}"] = time.monotonic()

    t_long = threading.Thread(target=long_request)
    t_long.start()
    time.sleep(0.5)
    shorts = [threading.Thread(target=short, args=(i,)) for i in range(7)]
    for t in shorts:
        t.start()
    for t in shorts + [t_long]:
        t.join(900)
    r = results["long"]
    assert r.usage.prompt_tokens == n_long
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1
    assert len(first_token) == 7
    print(f"\ncontext not split: long prompt {n_long} tokens, {r.usage.completion_tokens} generated, "
          f"{r.choices[0].finish_reason}; {sum(first_token[i] < done['long'] for i in range(7))} of 7 short "
          f"streams had their first token before it finished")
    # the short ones streamed while the long prompt was still being worked on
    assert sum(first_token[i] < done["long"] for i in range(7)) >= 5


def test_shared_system_prompt_is_prefilled_once(server, client, tokenizer):
    system = "You are a careful assistant. Follow these rules. " + " ".join(
        f"Rule {i}: answer briefly and politely." for i in range(1, 120))
    n_sys = len(tokenizer.chat_ids([{"role": "system", "content": system}], False))
    assert n_sys >= 1000
    ran0 = metric(server.url, "lmc_prompt_tokens_total")
    cached0 = metric(server.url, "lmc_cached_prompt_tokens_total")
    results: list = [None] * 8

    def one(i: int) -> None:
        results[i] = chat(client, [{"role": "system", "content": system},
                                   {"role": "user", "content": PROMPTS[i]}], 4)

    # all at once: the first admitted prefills the system prompt, the others wait for its blocks
    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    total = sum(r.usage.prompt_tokens for r in results)
    ran = metric(server.url, "lmc_prompt_tokens_total") - ran0
    cached = metric(server.url, "lmc_cached_prompt_tokens_total") - cached0
    full_blocks = n_sys // 16 * 16
    print(f"\nshared prefix: system prompt {n_sys} tokens, 8 requests, {int(total)} prompt tokens, "
          f"{int(ran)} run through the model, {int(cached)} found in the KV cache")
    assert cached >= 7 * (full_blocks - 16)
    assert ran + cached == total
    assert ran < total - 6 * 1000     # prefilled once, not eight times
    reused = sorted(r.usage.prompt_tokens_details.cached_tokens for r in results)
    assert all(n >= full_blocks - 16 for n in reused[1:]), reused


def test_full_server_503_and_drain_cuts_a_long_stream(smollm2):
    with serve(smollm2, "-t", "2", "-c", "2048", "--parallel", "1", "--queue", "0", "--drain-timeout", "1") as s:
        lines: list[str] = []
        started = threading.Event()

        # ignore_eos: the stream must still run when the drain cuts it, whatever the sampled text
        body = {"prompt": "Once upon a time", "max_tokens": 1500, "temperature": 0.8, "seed": 1,
                "ignore_eos": True}
        t = threading.Thread(target=stream_into, args=(s.url, body, lines, started))
        t.start()
        assert started.wait(120)
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "server_busy"
        code, out, err = s.stop(signal.SIGTERM)
        t.join(60)
        assert code == 0 and "lmc serve: stopped" in out, err
        assert lines[-1] == "data: [DONE]"
        last = json.loads(lines[-2][6:])
        assert last["choices"][0]["finish_reason"] == "length"
        assert 0 < last["usage"]["completion_tokens"] < 1500
