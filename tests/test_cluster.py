"""``lmc serve --replicas`` / ``--autoscale`` (``runtime.cluster``): engine
replicas on Ray Serve behind the same OpenAI API, through the official
``openai`` client against real server processes and a real local Ray.

Greedy replies equal ``lmc chat`` and the single-process server's, whole
and streamed; prompts sharing a long system prompt find it in their
replica's KV cache (the router sees the replicas' real block hashes), far
more often than Ray's cache-blind default routing; a replica killed with
requests in flight leaves no request hanging and is back within a minute;
autoscaling adds a replica under load and removes it after. The routing
policy itself is checked without Ray in ``test_affinity``.
"""
from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from serve_process import ROOT, serve
from shared_data import SMOLLM2, instruct_models

#: one worker runs them all: one Ray cluster at a time, the module's server started once, on every
#: core (``conftest.whole_machine``: Ray's processes and the timed scaling below need them)
pytestmark = [pytest.mark.xdist_group("cluster"), pytest.mark.usefixtures("whole_machine")]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


# --- real servers ----------------------------------------------------------------------------------
pytest.importorskip("ray.serve", reason="Ray Serve is the cluster extra: pip install -e '.[cluster]'")


@pytest.fixture(scope="module")
def cluster(whole_machine):
    with serve(instruct_models()[SMOLLM2], "--replicas", "2", "-t", "1", "-c", "2048") as s:
        yield s


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def _metrics(server) -> str:
    return urllib.request.urlopen(f"{server.url}/metrics", timeout=30).read().decode()


def _replicas(server) -> dict[str, int]:
    """replica id -> its process id, from /metrics."""
    return {m.group(2): int(m.group(1)) for m in
            re.finditer(r'^lmc_replica\{host="[^"]*",pid="(\d+)",replica="([^"]+)"\} 1', _metrics(server), re.M)}


def _wait_replicas(server, n: int, timeout: float) -> dict[str, int]:
    """The replicas once ``n`` of them have published their stats (or what there is after ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while True:
        got = _replicas(server)
        if len(got) == n or time.monotonic() > deadline:
            return got
        time.sleep(1)


def _ask(client: openai.OpenAI, stream: bool, **kw) -> str:
    kw = {"model": client.models.list().data[0].id, "temperature": 0, "max_tokens": 40, **kw}
    if "messages" in kw:
        if not stream:
            return client.chat.completions.create(**kw).choices[0].message.content
        return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                       if c.choices)
    if not stream:
        return client.completions.create(**kw).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)


def test_greedy_replies_equal_lmc_chat_and_the_single_process_server(cluster, tmp_path):
    msgs = tmp_path / "messages.json"
    msgs.write_text(json.dumps(QUESTION))
    r = subprocess.run([sys.executable, "-m", "runtime.cli", "chat", instruct_models()[SMOLLM2], "--messages",
                        str(msgs), "--temp", "0", "-n", "40", "--json"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    want = json.loads(r.stdout.strip().splitlines()[-1])["text"]
    ours = _client(cluster)
    # the ingress serves the same app: the chat page and the compiler viewer of the served model too
    assert "<html" in urllib.request.urlopen(f"{cluster.url}/", timeout=60).read().decode().lower()
    passes = json.loads(urllib.request.urlopen(f"{cluster.url}/viz/api/passes", timeout=600).read())
    assert passes[0]["name"] == "frontend" and len(passes) > 3
    with serve(instruct_models()[SMOLLM2], "-t", "1", "-c", "2048") as single:
        one = _client(single)
        for stream in (False, True):
            assert _ask(ours, stream, messages=QUESTION) == want == _ask(one, stream, messages=QUESTION)
            assert _ask(ours, stream, prompt="Once upon a time") == _ask(one, stream, prompt="Once upon a time")


def test_a_grammar_failing_mid_generation_is_a_400_through_a_replica(cluster):
    """The replica's error event crosses Ray as it came: a 400 naming the
    field (an error event in a stream), and the cluster serves on."""
    from test_structured_output import AMBIGUOUS

    client = _client(cluster)
    msgs = [{"role": "user", "content": "Write many a letters."}]
    with pytest.raises(openai.BadRequestError) as e:
        _ask(client, False, messages=msgs, max_tokens=200, extra_body={"grammar": AMBIGUOUS})
    assert e.value.body["param"] == "grammar" and "cannot be enforced past" in e.value.body["message"]
    with pytest.raises(openai.APIError, match="cannot be enforced past"):
        _ask(client, True, messages=msgs, max_tokens=200, extra_body={"grammar": AMBIGUOUS})
    assert _ask(client, False, messages=msgs, max_tokens=8, extra_body={"regex": "a{3}"}) == "aaa"


def _system_prompts(n: int, words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    vocab = ("river stone garden quiet lamp market winter orange signal harbor copper meadow engine "
             "letter window forest silver bridge candle thunder").split()
    return [f"You are assistant number {i}. Rules: " + " ".join(rng.choice(vocab) for _ in range(words))
            for i in range(n)]


def _affinity(server) -> float:
    """4 system prompts of about 1,000 tokens, 6 requests each (their own
    question each time), the four sent together in each of 6 rounds: the
    share of prompt tokens found in a replica's cache, after each prompt's
    first request."""
    client = _client(server)
    model = client.models.list().data[0].id
    systems = _system_prompts(4, 960)
    cached = total = 0
    with ThreadPoolExecutor(4) as pool:
        for rnd in range(6):
            def one(i: int):
                r = client.chat.completions.create(model=model, max_tokens=2, temperature=0, messages=[
                    {"role": "system", "content": systems[i]},
                    {"role": "user", "content": f"Question {rnd}: what is rule {rnd + i}?"}])
                return r.usage
            for u in pool.map(one, range(4)):
                assert u.prompt_tokens > 900
                if rnd:
                    cached += u.prompt_tokens_details.cached_tokens
                    total += u.prompt_tokens
    return cached / total


def test_prompts_go_where_their_system_prompt_is_cached(cluster):
    ours = _affinity(cluster)
    with serve(instruct_models()[SMOLLM2], "--replicas", "2", "-t", "1", "-c", "2048",
               "--routing", "power-of-two") as blind:
        baseline = _affinity(blind)
    print(f"\nprompt tokens found in the replica's cache: cache-aware {ours:.1%}, power-of-two {baseline:.1%}")
    assert ours >= 0.9 and ours > baseline
    m = _metrics(cluster)
    assert re.search(r'^lmc_routing_decisions_total\{reason="cache"\} ([1-9]\d*)', m, re.M), m
    assert re.search(r'^lmc_cached_prompt_tokens_total\{replica="[^"]+"\} [1-9]', m, re.M)


def test_a_killed_replica_leaves_no_request_hanging(cluster):
    client = _client(cluster)
    before = _wait_replicas(cluster, 2, 30)
    assert len(before) == 2, before

    def one(i: int) -> tuple[str, str]:
        try:
            stream = client.chat.completions.create(
                model="", stream=True, temperature=0, max_tokens=120,
                messages=[{"role": "user", "content": f"Tell story number {i} about a dragon."}])
            reason = None
            for c in stream:
                if c.choices and c.choices[0].finish_reason:
                    reason = c.choices[0].finish_reason
            return "done", reason or "cut"
        except openai.APIError as e:   # a clear error, not a hang
            return "error", str(e)

    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(one, i) for i in range(16)]
        time.sleep(3)
        victim, pid = sorted(before.items())[0]
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        results = [f.result(timeout=240) for f in futures]   # none hangs
    assert len(results) == 16
    assert all(kind == "done" and reason in ("stop", "length", "error", "cut") or kind == "error"
               for kind, reason in results), results
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        now = _replicas(cluster)
        if len(now) == 2 and victim not in now:
            break
        time.sleep(1)
    assert len(now) == 2 and victim not in now, now   # a new replica took its place within 60 s
    print(f"\nreplica {victim} killed; {next(r for r in now if r not in before)} took its place in "
          f"{time.monotonic() - killed:.1f} s")
    print("\nafter the kill:", sorted(results))
    new = next(r for r in now if r not in before)
    with ThreadPoolExecutor(12) as pool:   # and serves: with 12 at once, the load reaches it
        list(pool.map(lambda i: _ask(client, False, messages=[{"role": "user", "content": f"Count to {i}."}],
                                     max_tokens=24), range(12)))
    time.sleep(2)   # its published stats reach the ingress
    assert re.search(rf'^lmc_requests_total\{{replica="{new}"\}} [1-9]', _metrics(cluster), re.M), _metrics(cluster)


def test_autoscaling_adds_a_replica_under_load_and_removes_it_after():
    with serve(instruct_models()[SMOLLM2], "--autoscale", "1:2", "-t", "1", "-c", "1024", "-np", "2",
               "--downscale-delay", "5") as s:
        client = _client(s)
        assert len(_wait_replicas(s, 1, 30)) == 1
        seen = []
        stop = time.monotonic() + 150

        def load(i: int) -> None:
            while time.monotonic() < stop and 2 not in seen:
                _ask(client, True, messages=[{"role": "user", "content": f"Write a long story, part {i}."}],
                     max_tokens=100)

        with ThreadPoolExecutor(8) as pool:
            work = [pool.submit(load, i) for i in range(8)]
            while time.monotonic() < stop and 2 not in seen:
                seen.append(len(_replicas(s)))
                time.sleep(2)
            for w in work:
                w.result(timeout=300)
        assert 2 in seen, seen
        up = time.monotonic() - (stop - 150)
        idle = time.monotonic()
        deadline = idle + 120
        while time.monotonic() < deadline and len(_replicas(s)) != 1:
            time.sleep(2)
        assert len(_replicas(s)) == 1
        print(f"\nautoscaling: 2 replicas {up:.0f} s after the load began, back to 1 {time.monotonic() - idle:.0f} s "
              f"after it ended")
