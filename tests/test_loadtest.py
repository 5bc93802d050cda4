"""``lmc loadtest`` against a real OpenAI-compatible server: llama.cpp's, from
the ``xllamacpp`` package, serving TinyStories-656K from ../shared (a real
model, fast enough for four parallel slots on two cores).

One llama.cpp server per process, so each runs in a child process that
prints its address and serves until its stdin closes."""
from __future__ import annotations

import http.server
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager

import pytest

from llamacpp_oracle import have_llamacpp
from runtime.cli import loadtest
from runtime.cli.common import CliError, Parser
from runtime.tools.loadtest import run_load_test
from shared_data import MODELS

MODEL = MODELS / "TinyStories-656K-Q8_0.gguf"

_SERVER = r"""
import os, sys
import xllamacpp as x
p = x.CommonParams()
p.model.path = sys.argv[1]
p.n_ctx = 2048          # 4 slots of 512, the model's training context
p.n_parallel = 4
p.port = 0
p.warmup = False
p.use_jinja = True
p.cpuparams.n_threads = len(os.sched_getaffinity(0))   # the worker's share of the cores
p.cpuparams_batch.n_threads = p.cpuparams.n_threads
if len(sys.argv) > 2:
    p.api_keys = [sys.argv[2]]
s = x.Server(p)
print(s.listening_address.rstrip("/"), flush=True)
sys.stdin.read()        # serve until the test closes our stdin
os._exit(0)
"""


@contextmanager
def _llama_server(api_key: str | None = None):
    have_llamacpp()
    if not MODEL.exists():
        pytest.skip("../shared (models and references) is absent")
    with tempfile.TemporaryFile("w+") as log:   # llama.cpp logs every request: a pipe would fill and block it
        child = subprocess.Popen([sys.executable, "-c", _SERVER, str(MODEL), *([api_key] if api_key else [])],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            addr = child.stdout.readline().strip()
            if not addr.startswith("http"):
                log.seek(0)
                pytest.fail("llama.cpp's server did not start:\n" + "\n".join(log.read().splitlines()[-5:]))
            yield addr
        finally:
            child.stdin.close()
            try:
                child.wait(20)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


@pytest.fixture(scope="module")
def server():
    with _llama_server() as addr:
        yield addr


@pytest.fixture(scope="module")
def keyed_server():
    with _llama_server(api_key="sekrit") as addr:
        yield addr


def _cli(argv: list[str]):
    """``lmc loadtest ...`` through the command's own parser and run()."""
    p = Parser(prog="lmc")
    loadtest.add_parser(p.add_subparsers(dest="cmd", parser_class=Parser))
    return loadtest.run(p.parse_args(["loadtest", *argv]))


def _sane_latencies(r: dict) -> None:
    t, itl = r["ttft_s"], r["itl_s"]
    assert 0 < t["p50"] <= t["p90"] <= t["p99"] <= r["wall_s"]
    assert 0 < t["mean"] <= r["wall_s"]
    assert 0 <= itl["p50"] <= itl["p90"] <= itl["p99"] <= r["wall_s"]
    assert r["aggregate_tok_s"] == pytest.approx(r["completion_tokens_total"] / r["wall_s"])
    assert r["per_stream_tok_s"]["p50"] > 0
    # TPOT: a request's time per token after its first; decode tok/s: the clients at that pace
    assert r["tpot_s"]["mean"] > 0 and r["tpot_s"]["p50"] > 0
    assert r["decode_tok_s"] == pytest.approx(min(r["clients"], r["requests"]) / r["tpot_s"]["mean"])


def test_chat_streams_complete_and_count_the_servers_tokens(server):
    r = run_load_test(server, clients=3, requests=7, max_tokens=12, prompt_tokens=20, details=True)
    assert r["model"] == str(MODEL)               # the first id of GET /v1/models
    assert r["url"] == server and r["endpoint"] == "chat" and r["clients"] == 3 and r["requests"] == 7
    assert (r["completed"], r["errors"], r["cancelled"], r["timed_out"]) == (7, 0, 0, False)
    per = r["per_request"]
    assert len(per) == 7 and all(q["error"] is None for q in per)
    usage = [q["usage_completion_tokens"] for q in per]
    assert all(u is not None and 1 <= u <= 12 for u in usage)
    assert r["completion_tokens_total"] == sum(usage)
    assert r["prompt_tokens_total"] == sum(q["prompt_tokens"] for q in per) >= 7 * 20   # >= a token a word
    assert sum(r["finish_reasons"].values()) == 7 and set(r["finish_reasons"]) <= {"length", "stop"}
    for q in per:   # llama.cpp streams a chunk per token; the EOS of a "stop" is counted but has no text
        assert q["text_chunks"] == q["usage_completion_tokens"] - (q["finish_reason"] == "stop")
        assert q["finish_reason"] == "stop" or q["usage_completion_tokens"] == 12
        assert 0 < q["ttft_s"] <= q["latency_s"] <= r["wall_s"]
    _sane_latencies(r)


def test_ignore_eos_runs_every_request_to_max_tokens(server):
    """With ``ignore_eos`` llama.cpp generates max_tokens whatever the model
    samples: every request does the same work (what a throughput comparison needs)."""
    r = run_load_test(server, clients=2, requests=4, max_tokens=40, prompt_tokens=8, ignore_eos=True, details=True)
    assert (r["completed"], r["errors"], r["ignore_eos"]) == (4, 0, True)
    assert [q["usage_completion_tokens"] for q in r["per_request"]] == [40] * 4
    assert r["finish_reasons"] == {"length": 4} and r["completion_tokens_total"] == 160


def test_synthetic_prompts_differ_so_the_prefix_cache_cannot_hide_prefill(server):
    """llama.cpp reports, in usage.prompt_tokens_details.cached_tokens, the
    prompt tokens its prefix cache served: most of a repeated fixed prompt,
    no more than the chat template's opening of a synthetic one."""
    r = run_load_test(server, clients=1, requests=4, max_tokens=2, prompt_tokens=24, details=True)
    assert r["completed"] == 4 and len({q["prompt_tokens"] for q in r["per_request"]}) > 1
    assert all(q["cached_tokens"] < q["prompt_tokens"] // 4 for q in r["per_request"])   # ~9: the template's
    assert r["cached_prompt_tokens_total"] == sum(q["cached_tokens"] for q in r["per_request"])

    fixed = "the river and the garden and the forest " * 3
    r = run_load_test(server, clients=1, requests=3, max_tokens=2, prompt=fixed, details=True)
    assert all(q["cached_tokens"] >= q["prompt_tokens"] - 2 for q in r["per_request"][1:])


def test_completions_endpoint_with_a_fixed_prompt(server):
    r = run_load_test(server, clients=2, requests=4, max_tokens=8, prompt="Once upon a time", endpoint="completions",
                      details=True)
    assert (r["completed"], r["errors"], r["endpoint"]) == (4, 0, "completions")
    assert len({q["prompt_tokens"] for q in r["per_request"]}) == 1   # the same prompt each time
    assert r["completion_tokens_total"] == sum(q["usage_completion_tokens"] for q in r["per_request"])
    _sane_latencies(r)


def test_time_bound_cancels_what_is_in_flight_and_reports_what_finished(server):
    start = time.perf_counter()
    r = run_load_test(server, clients=2, requests=1000, max_tokens=400, timeout=1.0)
    assert time.perf_counter() - start < 5
    assert r["timed_out"] is True
    assert r["cancelled"] == 2                    # each client had a request in flight
    assert r["completed"] + r["errors"] + r["cancelled"] < 1000
    assert r["errors"] == 0 and r["wall_s"] <= 1.0


def test_wrong_api_key_makes_every_request_an_error_and_exit_1(keyed_server, capsys):
    assert _cli([keyed_server, "--clients", "2", "--requests", "5", "--max-tokens", "4"]) == 1
    r = json.loads(capsys.readouterr().out)       # the report is still printed
    assert (r["completed"], r["errors"], r["timed_out"]) == (0, 5, False)
    assert r["error_messages"] == {"401 Invalid API Key": 5}
    assert r["model"] is None                     # GET /v1/models was refused too
    assert r["ttft_s"] == {"p50": None, "p90": None, "p99": None, "mean": None}
    assert r["completion_tokens_total"] == 0 and r["finish_reasons"] == {}

    assert _cli([keyed_server, "--requests", "2", "--max-tokens", "4", "--api-key", "sekrit", "--completions"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["completed"], r["errors"]) == (2, 0) and r["model"] == str(MODEL)


def test_a_prompt_over_the_context_is_an_error_of_each_request(server):
    """llama.cpp answers 400 (exceed_context_size_error) before streaming."""
    r = run_load_test(server, clients=2, requests=3, max_tokens=4, prompt_tokens=600)
    assert (r["completed"], r["errors"], r["completion_tokens_total"]) == (0, 3, 0)
    assert sum(r["error_messages"].values()) == 3
    assert all(m.startswith("400 request (") and "exceeds the available context size (512 tokens)" in m
               for m in r["error_messages"])
    assert r["ttft_s"]["p50"] is None and r["per_stream_tok_s"]["p50"] is None


# --- what llama.cpp does not do: a canned server ------------------------------------------------

class _Canned(http.server.BaseHTTPRequestHandler):
    """An OpenAI-like server whose chat stream is ``STREAMS[n-th request % len]``, as is."""

    STREAMS = [
        # no usage chunk: the tokens are the text chunks; an empty text chunk is not a token
        'data: {"choices":[{"delta":{"role":"assistant"}}]}\n\n'
        'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
        'data: {"choices":[{"delta":{"content":""}}]}\n\n'
        ': a comment\n\n'
        'data: {"choices":[{"delta":{"content":"b"},"finish_reason":"stop"}]}\n\n'
        'data: [DONE]\n\n',
        # llama.cpp's way of failing inside a stream
        'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
        'error: {"code":500,"message":"out of memory","type":"server_error"}\n\n'
        'data: [DONE]\n\n',
        # cut short: no finish reason, no [DONE]
        'data: {"choices":[{"delta":{"content":"a"}}]}\n\n',
    ]
    count = 0

    def log_message(self, *args) -> None:
        pass

    def _send(self, status: int, body: str, ctype: str) -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._send(200, json.dumps({"object": "list", "data": [{"id": "canned"}]}), "application/json")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["model"] == "canned" and body["stream"] is True and body["messages"][0]["role"] == "user"
        assert "ignore_eos" not in body           # only when asked for
        i = type(self).count
        type(self).count += 1
        self._send(200, self.STREAMS[i % len(self.STREAMS)], "text/event-stream")


def test_stream_parsing_without_usage_with_error_events_and_cut_streams():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Canned)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        r = run_load_test(f"http://127.0.0.1:{srv.server_port}/v1/", clients=1, requests=3, max_tokens=4,
                          details=True)
    finally:
        srv.shutdown()
        srv.server_close()
    assert (r["model"], r["completed"], r["errors"]) == ("canned", 1, 2)
    assert r["completion_tokens_total"] == 2 and r["prompt_tokens_total"] is None
    assert r["finish_reasons"] == {"stop": 1}
    assert r["error_messages"] == {"error in the stream: out of memory": 1,
                                   "the stream ended without a finish reason or [DONE]": 1}


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_server_is_a_cli_error():
    url = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(CliError, match=rf"^{url}: cannot connect \(ConnectError: "):
        _cli([url])


def test_bad_flags_are_cli_errors():
    for argv in (["x", "--clients", "0"], ["x", "--prompt", "a", "--prompt-tokens", "3"],
                 ["x", "--chat", "--completions"], ["x", "--timeout", "0"], ["x", "--max-tokens", "many"]):
        with pytest.raises(CliError):
            _cli(argv)


def test_lmc_loadtest_unreachable_exits_2_with_one_line(capsys):
    from runtime.cli import main

    url = f"http://127.0.0.1:{_closed_port()}"
    assert main(["loadtest", url, "--requests", "1"]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.startswith(f"lmc: error: {url}: cannot connect (") and out.err.count("\n") == 1
    assert main(["loadtest", url, "--clients", "-1"]) == 2
