"""``lmc bench MODEL --serve``: real servers, real load, and what the JSON
must say about it.

The numbers are checked for their relationships only (every request
completed and, with ignore_eos, made exactly --gen-tokens tokens; the
aggregate is the tokens over the wall time ...): a timing never decides a
test. The llama.cpp comparison runs on TinyStories-656K from ../shared when
the xllamacpp package is installed, and is skipped otherwise.
"""
from __future__ import annotations

import argparse
import json
import random

import httpx
import pytest

from compiler.codegen.target import cpu_model
from runtime.cli import DEFAULT_MODEL, DEFAULT_TOKENIZER, main
from runtime.cli.bench import stream_counts
from runtime.tools.bench_servers import llamacpp_server, llamacpp_version, lmc_server
from runtime.tools.loadtest import synthetic_prompt
from runtime.tools.serve_bench import request_context
from shared_data import MODELS

GGUF = MODELS / "TinyStories-656K-Q8_0.gguf"
SMALL = ["--serve", "--streams", "1,2", "--gen-tokens", "8", "--prompt-tokens", "8", "-t", "2"]


def _bench(capsys, model: str, *argv: str) -> tuple[dict, list[str]]:
    """``lmc bench MODEL ARGV`` through ``runtime.cli.main``: (the JSON, the lines after it)."""
    assert main(["bench", model, *argv]) == 0
    lines = capsys.readouterr().out.splitlines()
    return json.loads(lines[0]), lines[1:]


def _check_rows(r: dict, server: str, streams: list[int], gen: int, words: int) -> None:
    assert [row["streams"] for row in r["rows"]] == streams
    for row in r["rows"]:
        s, n = row[server], row["streams"]
        assert (s["clients"], s["requests"]) == (n, 2 * n)          # each client sends two in a row
        assert (s["completed"], s["errors"], s["timed_out"]) == (2 * n, 0, False)
        assert "error_messages" not in s
        # ignore_eos: every request ran to max_tokens, whatever the model sampled
        assert s["completion_tokens_total"] == 2 * n * gen
        assert s["finish_reasons"] == {"length": 2 * n}
        assert s["prompt_tokens_total"] >= 2 * n * words             # at least a token a word
        assert s["aggregate_tok_s"] > 0
        assert s["aggregate_tok_s"] == pytest.approx(s["completion_tokens_total"] / s["wall_s"], rel=1e-3)
        assert 0 < s["ttft_p50_s"] <= s["ttft_p99_s"] <= s["wall_s"]
        assert s["itl_p50_s"] >= 0 and s["per_stream_tok_s_p50"] > 0
        # (the JSON keeps 6 significant digits)
        assert s["decode_tok_s"] == pytest.approx(n / s["tpot_mean_s"], rel=1e-5)


def test_serve_bench_json_on_the_bundled_model(capsys):
    r, rest = _bench(capsys, str(DEFAULT_MODEL), "-z", str(DEFAULT_TOKENIZER), *SMALL, "--json")
    assert rest == []                                                # --json: the JSON object alone
    assert (r["model"], r["threads"], r["parallel"]) == ("stories260K.bin", 2, 2)   # parallel: the most streams
    assert r["cpu_model"] == cpu_model() and r["cpu_model"]
    assert (r["gen_tokens"], r["prompt_tokens"], r["ignore_eos"], r["endpoint"]) == (8, 8, True, "chat")
    assert r["ctx_per_request"] % 16 == 0 and 8 + 8 < r["ctx_per_request"] <= 512
    _check_rows(r, "lmc", [1, 2], gen=8, words=8)
    assert all(set(row) == {"streams", "lmc"} for row in r["rows"])   # no llama.cpp unless asked
    assert r["lmc_scaling_8_vs_1"] is None                           # no 8-stream row


def test_parallel_below_the_streams_queues_the_rest(capsys):
    r, _ = _bench(capsys, str(DEFAULT_MODEL), "-z", str(DEFAULT_TOKENIZER), *SMALL, "--parallel", "1", "--json")
    assert r["parallel"] == 1
    _check_rows(r, "lmc", [1, 2], gen=8, words=8)


def test_compare_llamacpp_on_a_small_gguf(capsys):
    if llamacpp_version() is None:
        pytest.skip("xllamacpp (llama.cpp's server as a Python package) is not installed")
    if not GGUF.exists():
        pytest.skip(f"{GGUF} is absent (../shared)")
    r, table = _bench(capsys, str(GGUF), *SMALL, "--compare-llamacpp")
    assert r["model"] == GGUF.name and r["llamacpp_version"] and "llamacpp_error" not in r
    for server in ("lmc", "llamacpp"):
        _check_rows(r, server, [1, 2], gen=8, words=8)
    for row in r["rows"]:
        assert row["ratio_aggregate"] == pytest.approx(row["lmc"]["aggregate_tok_s"] /
                                                       row["llamacpp"]["aggregate_tok_s"], rel=1e-3)
    assert r["lmc_scaling_8_vs_1"] is None and r["llamacpp_scaling_8_vs_1"] is None
    # without --json, a table follows: one line per stream count and server
    body = [ln.split() for ln in table if ln[:1] == " "]
    assert [(cols[0], cols[1]) for cols in body] == [("1", "lmc"), ("1", "llama.cpp"), ("2", "lmc"), ("2", "llama.cpp")]


def test_request_context_fits_any_synthetic_prompt_and_the_reply():
    from frontends.loader import load_model

    tok = load_model(DEFAULT_MODEL, DEFAULT_TOKENIZER).tokenizer
    ctx = request_context(tok, 512, 20, 30)
    assert ctx % 16 == 0 and ctx <= 512
    rng = random.Random(0)
    for _ in range(50):
        ids = tok.chat_ids([{"role": "user", "content": synthetic_prompt(20, rng)}], True)
        assert len(ids) + 30 <= ctx
    assert request_context(tok, 200, 20, 30) == 200                  # at most the model's context


def test_stream_counts():
    assert stream_counts("1,4,8,16") == [1, 4, 8, 16]
    assert stream_counts("8,1,8") == [8, 1]
    for bad in ("", "1,,2", "0", "1.5", "-2", "2000"):
        with pytest.raises(argparse.ArgumentTypeError):
            stream_counts(bad)


@pytest.mark.parametrize("argv, message", [
    (["--serve", "--streams", "1,x"], "--streams takes whole numbers"),
    (["--serve", "--streams", "0"], "--streams: 0 is not between 1 and 1024"),
    (["--streams", "1,2"], "--streams is a flag of lmc bench --serve"),
    (["--parallel", "2"], "--parallel is a flag of lmc bench --serve"),
    (["--serve", "--parallel", "0"], "--parallel must be >= 1"),
    (["--serve", "--stream", "layers"], "not with --serve"),
    (["--serve", "--compare-llamacpp"], "needs a GGUF file"),
    (["--serve", "--prompt-tokens", "400"], "do not fit the model's context of 512"),
])
def test_bad_flags_are_one_line_and_exit_2(capsys, argv, message):
    assert main(["bench", str(DEFAULT_MODEL), "-z", str(DEFAULT_TOKENIZER), *argv]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith("lmc: error: ") and out.err.count("\n") == 1
    assert message in out.err


def test_a_server_that_does_not_start_is_one_line_and_exit_2(capsys):
    """q8 needs head_dim a multiple of 32; stories260K has 8: lmc serve exits, and says why."""
    assert main(["bench", str(DEFAULT_MODEL), "-z", str(DEFAULT_TOKENIZER), *SMALL, "--kv-type", "q8"]) == 2
    out = capsys.readouterr()
    errors = [ln for ln in out.err.splitlines() if not ln.startswith("lmc bench: ")]   # not the progress lines
    assert out.out == "" and len(errors) == 1 and out.err.endswith(errors[0] + "\n")
    assert errors[0].startswith("lmc: error: lmc serve exited: lmc: error: ") and "head_dim 8" in errors[0]


def _down(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=5)
    except httpx.ConnectError:
        return True
    return False


def test_servers_are_stopped_even_on_keyboard_interrupt():
    with pytest.raises(KeyboardInterrupt), lmc_server(str(DEFAULT_MODEL), str(DEFAULT_TOKENIZER), 1, 1, 64) as url:
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        raise KeyboardInterrupt
    assert _down(url)
    if llamacpp_version() is None or not GGUF.exists():
        return
    with pytest.raises(KeyboardInterrupt), llamacpp_server(str(GGUF), 1, 1, 256) as url:
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        raise KeyboardInterrupt
    assert _down(url)
