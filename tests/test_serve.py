"""``lmc serve`` as a client meets it: a real server process on a free
loopback port, the official ``openai`` client and plain HTTP (httpx).

This file uses the bundled stories260K (no chat template: ``plain``), so it
runs everywhere: the API's shapes, streaming, errors and a fuzz of hostile
bodies, the API key, the bounded queue, clients that disconnect, a drain on
SIGTERM, and model drafters (``--draft``, ``--draft-layers``): greedy text as
without them. ``test_serve_instruct.py`` does the acceptance on a real
instruct model.
"""
from __future__ import annotations

import collections
import contextlib
import json
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from runtime.cli import DEFAULT_MODEL, DEFAULT_TOKENIZER
from serve_process import ROOT, serve, stream_into
from shared_data import MODELS, needs_shared

ARGS = ("-z", str(DEFAULT_TOKENIZER), "-t", "2", "-c", "256", "--parallel", "4")


def metric(url: str, name: str, headers: dict | None = None) -> float:
    text = httpx.get(f"{url}/metrics", headers=headers).text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def wait_for(cond, timeout: float = 20.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


@pytest.fixture(scope="module")
def server():
    with serve(str(DEFAULT_MODEL), *ARGS) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_banner_health_models(server):
    assert server.url.startswith("http://127.0.0.1:")   # loopback unless told otherwise
    assert "parallel 4, context 256" in server.banner
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    models = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x").models.list()
    assert [m.id for m in models.data] == ["stories260K"]


def test_completion_whole_and_streamed(server, client):
    prompt = "Once upon a time"
    whole = client.completions.create(model="stories260K", prompt=prompt, max_tokens=24, temperature=0)
    text = whole.choices[0].text
    ids = httpx.post(f"{server.url}/tokenize", json={"content": prompt, "add_special": True}).json()["tokens"]
    assert whole.usage.prompt_tokens == len(ids)
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    assert whole.choices[0].finish_reason in ("stop", "length")
    if whole.choices[0].finish_reason == "length":
        assert whole.usage.completion_tokens == 24
    parts, reasons = [], []
    for chunk in client.completions.create(model="stories260K", prompt=prompt, max_tokens=24, temperature=0,
                                           stream=True):
        parts.append(chunk.choices[0].text)
        reasons.append(chunk.choices[0].finish_reason)
    assert "".join(parts) == text and len(parts) > 5
    assert reasons[-1] == whole.choices[0].finish_reason and set(reasons[:-1]) == {None}
    # the same as lmc run gives
    import runtime

    m = runtime.load(DEFAULT_MODEL, DEFAULT_TOKENIZER, ctx=256, threads=2)
    want = m.tokenizer.decode(list(m.generate(ids, 24, temperature=0.0)))
    assert text == want


def test_raw_sse_ends_with_done(server):
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": "Tom"}], "max_tokens": 5, "stream": True,
                            "stream_options": {"include_usage": True}}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] <= 5
    assert chunks[-2]["choices"][0]["finish_reason"] in ("stop", "length")


def test_logprobs_null_is_off(server):
    """Some OpenAI clients send "logprobs": null; it means off, not a 400."""
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "Lily"}], "max_tokens": 2, "logprobs": None})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0].get("logprobs") is None


def test_logprobs_and_tokenize_roundtrip(server, client):
    r = client.chat.completions.create(model="stories260K", messages=[{"role": "user", "content": "Lily"}],
                                       max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    lps = r.choices[0].logprobs.content
    assert len(lps) == r.usage.completion_tokens
    for lp in lps:
        assert lp.logprob <= 0 and len(lp.top_logprobs) == 3
        assert lp.top_logprobs[0].logprob >= lp.logprob - 1e-6   # greedy: the chosen one is the most likely
        assert lp.top_logprobs[0].token == lp.token
    ids = httpx.post(f"{server.url}/tokenize", json={"content": "Lily and Tom"}).json()["tokens"]
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json()["content"].strip() == "Lily and Tom"


# --- refusals -------------------------------------------------------------------------------
BAD = [
    ("POST", "/v1/chat/completions", b"{not json", 400),
    ("POST", "/v1/chat/completions", b"[]", 400),
    ("POST", "/v1/chat/completions", {"messages": "hello"}, 400),
    ("POST", "/v1/chat/completions", {"messages": []}, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": -1}, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": 0}, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 2}, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": "gpt-4"}, 404),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": [""]}, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 400}]}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 300}, 400),
    ("POST", "/v1/completions", {"prompt": [1, 2, 10 ** 6]}, 400),
    ("POST", "/v1/completions", {"prompt": []}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "echo": True}, 400),
    ("POST", "/v1/completions", {"prompt": {"a": 1}}, 400),
    ("POST", "/detokenize", {"tokens": [-5]}, 400),
    ("POST", "/tokenize", {"content": 5}, 400),
    # an assistant turn's tool calls: a list of {"function": {"name", "arguments"}} (was a 500 for 5)
    *[("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"},
                                                     {"role": "assistant", "content": "y", "tool_calls": calls},
                                                     {"role": "user", "content": "z"}]}, 400)
      for calls in (5, "abc", {"a": 1}, [5], [{}], [{"function": 5}], [{"function": {"arguments": "{}"}}],
                    [{"function": {"name": "f", "arguments": 5}}])],
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "repeat_penalty": 1e-300}, 400),
    # fields that would change the answer are refused rather than ignored: a role OpenAI does not
    # have, best_of > 1, a suffix, top_logprobs without logprobs, a logit_bias lmc cannot apply
    ("POST", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "best_of": 2}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "suffix": "and then"}, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400),
    *[("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logit_bias": bias}, 400)
      for bias in ({"abc": 1}, {"5": 1000}, {"100000": 5}, {"-1": 5}, {"5": "high"}, [5])],
    ("GET", "/v1/nothing", None, 404),
    ("GET", "/v1/chat/completions", None, 405),
]


@pytest.mark.parametrize("method,path,body,status", BAD)
def test_bad_requests_get_openai_errors(server, method, path, body, status):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body} if body is not None else {}
    r = httpx.request(method, f"{server.url}{path}", timeout=30, headers={"content-type": "application/json"}, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and "Traceback" not in err["message"]
    assert err["type"]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_invalid_json_names_no_parameter(server):
    """A body that is not JSON: the message says so and where; no made-up parameter
    (pydantic's location of a JSON error is a character offset: it was reported as param "1")."""
    r = httpx.post(f"{server.url}/v1/chat/completions", content=b'{"messages": [}', timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] is None and err["message"].startswith("the body is not valid JSON (at character"), err


def test_logit_bias_steers_the_choice(server, client):
    """OpenAI's logit_bias, applied before sampling: -100 on the greedy first token makes
    another come first; +100 on a token makes it the first."""
    msgs = [{"role": "user", "content": "Lily"}]
    base = client.chat.completions.create(model="stories260K", messages=msgs, max_tokens=1, temperature=0,
                                          logprobs=True, top_logprobs=3)
    first = base.choices[0].logprobs.content[0]
    ids = httpx.post(f"{server.url}/tokenize", json={"content": base.choices[0].message.content}).json()["tokens"]
    banned = client.chat.completions.create(model="stories260K", messages=msgs, max_tokens=1, temperature=0,
                                            logit_bias={str(ids[0]): -100}, logprobs=True, top_logprobs=3)
    assert banned.choices[0].logprobs.content[0].token != first.token
    other = first.top_logprobs[2].token
    oid = httpx.post(f"{server.url}/tokenize", json={"content": other}).json()["tokens"]
    forced = client.chat.completions.create(model="stories260K", messages=msgs, max_tokens=1, temperature=0,
                                            logit_bias={str(oid[-1]): 100}, logprobs=True)
    assert forced.choices[0].logprobs.content[0].token == httpx.post(
        f"{server.url}/detokenize", json={"tokens": [oid[-1]]}).json()["content"]


def test_developer_role_is_the_system_message(server):
    """OpenAI's "developer" role reaches the template as the system message."""
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "developer", "content": "Be brief."},
                                      {"role": "user", "content": "Lily"}], "max_tokens": 2, "temperature": 0})
    s = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Lily"}], "max_tokens": 2, "temperature": 0})
    assert r.status_code == s.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == s.json()["choices"][0]["message"]
    ru, su = r.json()["usage"], s.json()["usage"]
    assert ru["prompt_tokens"] == su["prompt_tokens"]
    # the second prompt found the first one's tokens in the prefix cache, all of them: the same prompt
    assert su["prompt_tokens_details"]["cached_tokens"] >= su["prompt_tokens"] - 1


def test_oversized_body_is_413(server):
    r = httpx.post(f"{server.url}/v1/completions", content=b"x" * (9 << 20), timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and "MiB" in r.json()["error"]["message"]


def test_oversized_chunked_body_is_413(server):
    """Without Content-Length (chunked transfer) the body is counted as it
    arrives: a 12 MiB prompt is refused, not read and tokenized whole."""
    def chunks():
        yield b'{"prompt": "'
        for _ in range(12):
            yield b"a " * (1 << 19)
        yield b'", "max_tokens": 1}'

    r = httpx.post(f"{server.url}/v1/completions", content=chunks(), timeout=120,
                   headers={"content-type": "application/json"})
    assert "content-length" not in r.request.headers and r.request.headers["transfer-encoding"] == "chunked"
    assert r.status_code == 413 and "MiB" in r.json()["error"]["message"], r.text
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_a_non_numeric_content_length_is_400(server):
    import socket

    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as c:
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: abc\r\nConnection: close\r\n\r\n{}")
        reply = b""
        while chunk := c.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 400"), reply[:200]


#: values no request may carry in each field
INVALID = {
    "messages": ["hi", 5, None, {}, [], [[]], [{"role": 5}], [{"content": "x"}], [{"role": None, "content": "x"}],
                 [{"role": "user", "content": {"x": 1}}], [{"role": "user", "content": [{"type": "audio"}]}]],
    "max_tokens": ["ten", -1, 0, 1.5, 10 ** 6, [], {}, True],
    "temperature": [-1, 2.5, "hot", [], {}, 1e308, "NaN"],
    "top_p": [0, -0.5, 1.5, "x", []],
    "top_k": [-1, "x", 1.5, [], {}],
    "min_p": [-0.1, 1, "x", []],
    "stop": [[""], "", 5, [1, 2], {"a": 1}, [None]],
    "stream": ["yes", 5, [], {}],
    "seed": ["x", 1.5, [], {}],
    "n": [0, 2, "x", -3],
    "logprobs": ["all", [], {}, 3],
    "top_logprobs": [-1, 21, "x", []],
    "presence_penalty": [3, -3, "x", []],
    "frequency_penalty": [2.5, "x", {}],
    "model": ["gpt-4", 5, [], {}],
    "response_format": [{"type": "xml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"not": {}}}}, "json", 5],
    "grammar": ["start: foo", 5, [], "start: /[a-/"],
    "regex": ["[a-", 5, {}],
}


def _hostile_bodies(n: int, seed: int = 1) -> list[bytes]:
    """Chat bodies no server may accept: broken JSON, a wrong type or range
    in a field (one or several at once), deep nesting, bytes that are not
    UTF-8, the wrong top-level type."""
    rng = random.Random(seed)
    good = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    out: list[bytes] = []
    while len(out) < n:
        kind = rng.randrange(6)
        if kind == 0:   # a valid body cut short
            raw = json.dumps(good).encode()
            out.append(raw[: rng.randrange(1, len(raw) - 1)])
        elif kind in (1, 2):   # one or several fields wrong
            body = json.loads(json.dumps(good))
            for field in rng.sample(sorted(INVALID), 1 if kind == 1 else 3):
                body[field] = rng.choice(INVALID[field])
            raw = json.dumps(body).replace('"NaN"', "NaN")
            out.append(raw.encode())
        elif kind == 3:   # deep nesting
            d = rng.randrange(50, 3000)
            out.append(b'{"messages": ' + b"[" * d + b"]" * d + b"}")
        elif kind == 4:   # not UTF-8, not JSON
            out.append(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))) + b"\xff")
        else:   # the wrong top-level type
            out.append(json.dumps(rng.choice([[good], "text", 42, None])).encode())
    return out


def test_fuzz_hostile_bodies(server):
    bodies = _hostile_bodies(240)
    statuses = []
    with httpx.Client(timeout=30) as c:
        for i, body in enumerate(bodies):
            r = c.post(f"{server.url}/v1/chat/completions", content=body, headers={"content-type": "application/json"})
            statuses.append(r.status_code)
            assert 400 <= r.status_code < 500, (body[:200], r.status_code, r.text[:300])
            assert "error" in r.json()
    assert server.proc.poll() is None
    print(f"\nfuzz: {len(bodies)} hostile bodies, statuses {dict(sorted(collections.Counter(statuses).items()))}")
    assert wait_for(lambda: metric(server.url, "lmc_kv_blocks_used") == 0)
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Tom", "max_tokens": 3}, timeout=60)
    assert ok.status_code == 200


def test_disconnected_clients_free_their_blocks(server, client):
    def leave_early() -> None:
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                          json={"prompt": "Once upon a time", "max_tokens": 200, "stream": True}) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i >= 4:
                    break     # closes the connection mid-stream

    threads = [threading.Thread(target=leave_early) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert wait_for(lambda: metric(server.url, "lmc_kv_blocks_used") == 0
                    and metric(server.url, "lmc_running_sequences") == 0)
    assert metric(server.url, "lmc_generated_tokens_total") < 16 * 200
    print(f"\n16 clients left mid-stream: blocks in use {metric(server.url, 'lmc_kv_blocks_used'):.0f}, "
          f"running {metric(server.url, 'lmc_running_sequences'):.0f}")
    r = client.completions.create(model="stories260K", prompt="Tom", max_tokens=8, temperature=0)
    assert r.usage.completion_tokens >= 1


def test_metrics_count_requests_and_tokens(server, client):
    before = metric(server.url, "lmc_generated_tokens_total")
    reqs = metric(server.url, "lmc_requests_total")
    r = client.completions.create(model="stories260K", prompt="Lily", max_tokens=7, temperature=0)
    assert metric(server.url, "lmc_generated_tokens_total") - before == r.usage.completion_tokens
    assert metric(server.url, "lmc_requests_total") - reqs == 1
    for name in ("lmc_queue_depth", "lmc_running_sequences", "lmc_kv_blocks_total", "lmc_batch_size_count",
                 "lmc_generation_tokens_per_second", "lmc_prompt_tokens_total"):
        metric(server.url, name)
    assert metric(server.url, "lmc_kv_blocks_total") == 4 * 256 // 16


def test_prompt_lookup_per_request(server, client):
    """The ``lookup`` field turns prompt lookup on for one request (the
    openai client sends it through ``extra_body``): the same greedy text as
    without it, drafted tokens checked and kept (metrics)."""
    prompt = "Lily had a red ball. Lily had a red ball. Lily had a red ball. Lily had a"
    plain = client.completions.create(model="stories260K", prompt=prompt, max_tokens=40, temperature=0)
    drafted = metric(server.url, "lmc_draft_tokens_total")
    kept = metric(server.url, "lmc_draft_accepted_tokens_total")
    fast = client.completions.create(model="stories260K", prompt=prompt, max_tokens=40, temperature=0,
                                     extra_body={"lookup": 3, "draft_max": 3})
    assert fast.choices[0].text == plain.choices[0].text
    assert fast.usage.completion_tokens == plain.usage.completion_tokens
    assert metric(server.url, "lmc_draft_accepted_tokens_total") > kept
    assert metric(server.url, "lmc_draft_tokens_total") > drafted
    bad = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "lookup": -1})
    assert bad.status_code == 400 and "lookup" in bad.text


# --- model drafters: servers of their own ---------------------------------------------------------
STORIES_Q8 = str(MODELS / "stories260K-q8.bin")
DRAFTERS = {
    "draft-layers-1": ("--draft-layers", "1"),
    "draft-layers-4": ("--draft-layers", "4"),
    "draft": ("--draft", STORIES_Q8, "--draft-tokenizer", str(DEFAULT_TOKENIZER)),
}
PROMPTS = ["Once upon a time", "Lily saw a big red ball", "Tom and his dog went to the park", "The sun",
           "A little bird sang a song. The bird", "Sue had a cat named Tim. One day", "Ben was sad because",
           "There was a tall tree in the garden"]
LENGTHS = [40, 7, 23, 64, 3, 31, 50, 12]


@pytest.fixture(scope="module")
def drafting():
    """``drafting(name)``: a server (8 sequences at a time) with that drafter, started once."""
    with contextlib.ExitStack() as stack:
        started: dict[str, object] = {}

        def get(name: str):
            if name not in started:
                started[name] = stack.enter_context(serve(str(DEFAULT_MODEL), *ARGS[:-1], "8", *DRAFTERS[name]))
            return started[name]

        yield get


def _openai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def _concurrently(url: str, bodies: list[dict]) -> list:
    """The completions of ``bodies``, sent all at once."""
    out: list = [None] * len(bodies)

    def one(i: int) -> None:
        out[i] = _openai(url).completions.create(model="stories260K", **bodies[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return out


def _tokens(r) -> list[str]:
    return r.choices[0].logprobs.tokens


@needs_shared
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_model_drafters_keep_greedy_tokens(server, drafting, name):
    """Eight different greedy requests at once: token for token what the
    server without a drafter gives; drafts were made and checked (some
    accepted; from the first layer alone, some rejected)."""
    bodies = [dict(prompt=p, max_tokens=n, temperature=0, logprobs=0) for p, n in zip(PROMPTS, LENGTHS)]
    want = _concurrently(server.url, bodies)
    s = drafting(name)
    assert "draft-max 8)" in s.banner
    drafted = metric(s.url, "lmc_draft_tokens_total")
    kept = metric(s.url, "lmc_draft_accepted_tokens_total")
    got = _concurrently(s.url, bodies)
    assert [_tokens(r) for r in got] == [_tokens(r) for r in want]
    assert [r.choices[0].text for r in got] == [r.choices[0].text for r in want]
    assert [r.usage.completion_tokens for r in got] == [r.usage.completion_tokens for r in want]
    drafted = metric(s.url, "lmc_draft_tokens_total") - drafted
    kept = metric(s.url, "lmc_draft_accepted_tokens_total") - kept
    assert drafted > 0, drafted
    if name == "draft-layers-1":
        assert kept < drafted, (drafted, kept)
    else:
        assert kept > 0, (drafted, kept)


@needs_shared
def test_draft_max_0_and_lookup_with_a_draft_model(server, client, drafting):
    """draft_max 0: nothing drafted for that request; lookup > 0: prompt
    lookup instead of the model; the same text either way."""
    s = drafting("draft")
    prompt = "Lily had a red ball. Lily had a red ball. Lily had a"
    want = client.completions.create(model="stories260K", prompt=prompt, max_tokens=40, temperature=0)
    c = _openai(s.url)
    drafted = metric(s.url, "lmc_draft_tokens_total")
    kept = metric(s.url, "lmc_draft_accepted_tokens_total")
    off = c.completions.create(model="stories260K", prompt=prompt, max_tokens=40, temperature=0,
                               extra_body={"draft_max": 0})
    assert off.choices[0].text == want.choices[0].text
    assert metric(s.url, "lmc_draft_tokens_total") == drafted
    assert metric(s.url, "lmc_draft_accepted_tokens_total") == kept
    looked = c.completions.create(model="stories260K", prompt=prompt, max_tokens=40, temperature=0,
                                  extra_body={"lookup": 3, "draft_max": 3})
    assert looked.choices[0].text == want.choices[0].text
    assert metric(s.url, "lmc_draft_tokens_total") > drafted
    bad = httpx.post(f"{s.url}/v1/completions", json={"prompt": "x", "draft_max": -1})
    assert bad.status_code == 400 and "draft_max" in bad.text


@needs_shared
def test_prefix_sharing_with_a_draft_model(server, client, drafting):
    """Two requests sharing a long prompt prefix: the second starts past the
    shared blocks (the draft's pool holds them too); both give what the
    server without a drafter gives."""
    s = drafting("draft")
    system = "Lily and Tom went to the park with their big red ball and their little dog. " * 3
    prompts = [system + "Then Ben came", system + "The dog was happy"]
    c = _openai(s.url)
    for p in prompts:
        want = client.completions.create(model="stories260K", prompt=p, max_tokens=30, temperature=0)
        got = c.completions.create(model="stories260K", prompt=p, max_tokens=30, temperature=0)
        assert got.choices[0].text == want.choices[0].text
    assert got.usage.prompt_tokens_details.cached_tokens >= 32


@needs_shared
def test_sampling_with_a_draft_model(drafting):
    """Temperature 0.8: drafts drawn from the draft's distribution and
    checked by the rejection rule; whole replies, whole and streamed."""
    s = drafting("draft")
    c = _openai(s.url)
    drafted = metric(s.url, "lmc_draft_tokens_total")
    bodies = [dict(prompt=p, max_tokens=30, temperature=0.8, seed=i) for i, p in enumerate(PROMPTS[:4])]
    for r in _concurrently(s.url, bodies):
        assert r.choices[0].finish_reason in ("stop", "length") and 1 <= r.usage.completion_tokens <= 30
        assert isinstance(r.choices[0].text, str)
    parts = [ch.choices[0].text for ch in c.completions.create(model="stories260K", prompt="Tom", max_tokens=20,
                                                                 temperature=0.8, seed=3, stream=True)]
    assert parts and "".join(parts)
    assert metric(s.url, "lmc_draft_tokens_total") > drafted


# --- a server of its own -----------------------------------------------------------------------
def test_api_key():
    with serve(str(DEFAULT_MODEL), *ARGS, "--api-key", "sesame") as s:
        assert httpx.get(f"{s.url}/health").status_code == 200
        for path in ("/v1/models", "/metrics"):
            r = httpx.get(f"{s.url}{path}")
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(f"{s.url}/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{s.url}/v1", api_key="nope", max_retries=0).completions.create(
                model="stories260K", prompt="x", max_tokens=2)
        good = openai.OpenAI(base_url=f"{s.url}/v1", api_key="sesame", max_retries=0)
        assert good.completions.create(model="stories260K", prompt="x", max_tokens=2).usage.completion_tokens >= 1


def test_sigterm_lets_a_running_stream_finish():
    """SIGTERM while a stream runs: it ends with its finish reason and
    [DONE] (within --drain-timeout), then the process exits 0. (Cutting a
    stream that outlives the grace period, and the 503 of a full server,
    are shown on a slower model in test_serve_instruct.py.)"""
    with serve(str(DEFAULT_MODEL), *ARGS, "--drain-timeout", "30") as s:
        lines: list[str] = []
        started = threading.Event()

        body = {"prompt": "Once", "max_tokens": 200}
        t = threading.Thread(target=stream_into, args=(s.url, body, lines, started))
        t.start()
        assert started.wait(60)
        code, out, err = s.stop(signal.SIGTERM)
        t.join(60)
        assert code == 0 and "lmc serve: stopped" in out, err
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] in ("length", "stop")


def test_cli_errors_are_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "runtime.cli", "serve", str(DEFAULT_MODEL), "--port", str(port)],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and f"--port {port}" in r.stderr, r.stderr
    cases = [(["--parallel", "0"], "--parallel"), (["-c", "100000"], "-c 100000"),
             (["--mem-budget", "10M"], "--mem-budget"), (["--chat-template", "nonesuch"], "nonesuch"),
             (["--draft-layers", "99"], "--draft-layers 99: the model has 5 layers (take 1 to 4)"),
             (["--draft", "nonesuch.bin"], "--draft nonesuch.bin: no such file"),
             (["--draft-layers", "1", "--draft", str(DEFAULT_MODEL)], "one drafter at a time")]
    if MODELS.is_dir():   # a draft of another vocabulary
        cases.append((["--draft", str(MODELS / "TinyStories-656K-Q8_0.gguf")],
                      "--draft TinyStories-656K-Q8_0.gguf: not the target's vocabulary"))
    for argv, msg in cases:
        r = subprocess.run([sys.executable, "-m", "runtime.cli", "serve", str(DEFAULT_MODEL), "-z",
                            str(DEFAULT_TOKENIZER), "--port", "0", *argv], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and msg in r.stderr, (argv, r.stderr)
        assert "Traceback" not in r.stderr
