"""The serve benchmark (``lmc bench MODEL --serve``): serving throughput under
concurrent streams, ours and (``--compare-llamacpp``) llama.cpp's server on
the same file.

The one-stream bench measures the decoder; a server earns its keep by
batching: N users at once should cost far less than N times one user. So
this starts ``lmc serve`` on the model, runs ``lmc loadtest`` against it at
each stream count (N clients, 2N requests: each client sends two in a row,
so the second wave arrives while others are mid-reply, as continuous
batching has to handle), and reports what users feel (time to first token,
inter-token latency, per-stream speed) beside what the machine delivers
(aggregate tokens per second).

The comparison is fair only if both servers do the same work: every
request asks for ``ignore_eos`` (each makes exactly ``--gen-tokens``
tokens, whatever the model samples), greedy, on the chat endpoint with the
model's own template, with synthetic prompts that differ per request (no
prefix cache can skip their prefill). llama.cpp gets the same threads, as
many slots as our ``--parallel``, continuous batching, and ``n_ctx`` =
slots x our per-request context, so each slot has the room ours has. The
servers run one after the other, never both at once: they would share the
cores. Each starts with a warm-up round (the largest stream count, a few
tokens each) that the figures leave out.
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

from ..errors import RunError
from .bench_servers import BenchServerError, llamacpp_server, llamacpp_version, lmc_server
from .loadtest import WORDS, ServerUnreachable, run_load_test, synthetic_prompt

DEFAULT_STREAMS = (1, 4, 8, 16)
DEFAULT_TOKENS = 64        # --gen-tokens and --prompt-tokens with --serve
WARMUP_TOKENS = 8
#: bound on each load test: a run that long has gone wrong
ROW_TIMEOUT_S = 3600.0


class _Always:
    """An rng whose every choice is ``word``: the synthetic prompt made of one word only."""

    def __init__(self, word: str) -> None:
        self.word = word

    def choice(self, seq: Any) -> str:
        return self.word


def request_context(tokenizer: Any, seq_len: int, prompt_words: int, gen_tokens: int) -> int:
    """The context each request gets (``lmc serve -c``; each llama.cpp slot
    likewise): room for the longest synthetic prompt, chat template
    included, plus the reply, plus slack for llama.cpp tokenizing or
    templating a little differently; a multiple of 16 (our KV block), at
    most the model's context. The longest prompt is the one repeating the
    word that takes the most tokens. ``RunError`` when even the prompt and
    the reply do not fit the model's context."""
    longest = max(len(tokenizer.chat_ids([{"role": "user", "content": synthetic_prompt(prompt_words, _Always(w))}],
                                         True)) for w in WORDS)
    need = longest + prompt_words // 4 + 8 + gen_tokens
    if need > seq_len:
        raise RunError(f"--prompt-tokens {prompt_words} (up to {longest} tokens with the chat template) and "
                       f"--gen-tokens {gen_tokens} do not fit the model's context of {seq_len}")
    return min(seq_len, -(-(need + 64) // 16) * 16)


def _summary(r: dict[str, Any]) -> dict[str, Any]:
    """The figures of one load test that the bench reports."""
    out = {"aggregate_tok_s": r["aggregate_tok_s"], "decode_tok_s": r["decode_tok_s"],
           "tpot_mean_s": r["tpot_s"]["mean"], "ttft_p50_s": r["ttft_s"]["p50"],
           "ttft_p99_s": r["ttft_s"]["p99"], "itl_p50_s": r["itl_s"]["p50"],
           "per_stream_tok_s_p50": r["per_stream_tok_s"]["p50"], "clients": r["clients"],
           "requests": r["requests"], "completed": r["completed"], "errors": r["errors"],
           "completion_tokens_total": r["completion_tokens_total"], "prompt_tokens_total": r["prompt_tokens_total"],
           "finish_reasons": r["finish_reasons"], "wall_s": r["wall_s"], "timed_out": r["timed_out"]}
    if r["error_messages"]:
        out["error_messages"] = r["error_messages"]
    return out


def measure_server(url: str, streams: list[int], gen_tokens: int, prompt_words: int,
                   say: Callable[[str], None] = lambda s: None, label: str = "") -> dict[int, dict[str, Any]]:
    """The warm-up round, then one load test per stream count: {streams: summary}."""
    load: dict[str, Any] = {"prompt_tokens": prompt_words, "endpoint": "chat", "temperature": 0.0,
                            "ignore_eos": True, "timeout": ROW_TIMEOUT_S}
    top = max(streams)
    try:
        warm = run_load_test(url, top, top, min(gen_tokens, WARMUP_TOKENS), **load)
        if not warm["completed"]:
            first = next(iter(warm["error_messages"]), "no request completed")
            raise BenchServerError(f"{label}: the warm-up failed: {first}")
        rows = {}
        for n in streams:
            rows[n] = _summary(run_load_test(url, n, 2 * n, gen_tokens, **load))
            say(f"{label}, {n} stream{'s' * (n > 1)}: {_fmt(rows[n]['aggregate_tok_s'], '{:.1f}')} tok/s in all, "
                f"{rows[n]['completed']}/{rows[n]['requests']} requests")
    except ServerUnreachable as e:          # it died under the load
        raise BenchServerError(f"{label}: {e}") from None
    return rows


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _scaling(rows: dict[int, dict[str, Any]], key: str = "aggregate_tok_s") -> float | None:
    """``key`` (tok/s) at 8 streams over 1 stream: how well batching pays."""
    if 1 in rows and 8 in rows:
        return _ratio(rows[8][key], rows[1][key])
    return None


def run_serve_bench(model: str, tokenizer: str | None, threads: int, streams: list[int],
                    parallel: int | None = None, gen_tokens: int = DEFAULT_TOKENS,
                    prompt_tokens: int = DEFAULT_TOKENS, compare_llamacpp: bool = False,
                    serve_args: list[str] | None = None,
                    say: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Measure ``lmc serve`` (and llama.cpp's server) on ``model``; the
    result is the JSON object ``lmc bench --serve`` prints (see the module
    docstring). ``serve_args`` go to ``lmc serve`` as they are; ``say``
    hears one progress line per step."""
    from frontends.loader import load_model

    loaded = load_model(model, tokenizer)     # the header and tokenizer only: to size the context
    if compare_llamacpp and loaded.format != "gguf":
        raise RunError(f"{model}: --compare-llamacpp needs a GGUF file (llama.cpp reads no other)")
    if compare_llamacpp and llamacpp_version() is None:
        raise RunError("--compare-llamacpp needs the xllamacpp package (pip install xllamacpp)")
    parallel = parallel or max(streams)
    ctx = request_context(loaded.tokenizer, loaded.config.seq_len, prompt_tokens, gen_tokens)
    from compiler.codegen.target import cpu_model

    out: dict[str, Any] = {"model": os.path.basename(os.fspath(model)), "threads": threads, "parallel": parallel,
                           "cpu_model": cpu_model(), "gen_tokens": gen_tokens, "prompt_tokens": prompt_tokens,
                           "ctx_per_request": ctx, "ignore_eos": True, "endpoint": "chat"}

    say(f"starting lmc serve (--parallel {parallel}, -c {ctx}, -t {threads}; the first run compiles)")
    with lmc_server(model, tokenizer, threads, parallel, ctx, serve_args) as url:
        ours = measure_server(url, streams, gen_tokens, prompt_tokens, say, "lmc serve")
    theirs: dict[int, dict[str, Any]] = {}
    if compare_llamacpp:
        out["llamacpp_version"] = llamacpp_version()
        say(f"starting llama.cpp's server ({parallel} slots, n_ctx {parallel * ctx}, {threads} threads)")
        try:
            with llamacpp_server(model, threads, parallel, parallel * ctx) as url:
                theirs = measure_server(url, streams, gen_tokens, prompt_tokens, say, "llama.cpp")
        except BenchServerError as e:    # ours is measured: report it, and why theirs is missing
            out["llamacpp_error"] = str(e)

    rows = []
    for n in streams:
        row: dict[str, Any] = {"streams": n, "lmc": ours[n]}
        if compare_llamacpp:
            row["llamacpp"] = theirs.get(n)
            row["ratio_aggregate"] = _ratio(ours[n]["aggregate_tok_s"], (theirs.get(n) or {}).get("aggregate_tok_s"))
        rows.append(row)
    out["rows"] = rows
    out["lmc_scaling_8_vs_1"] = _scaling(ours)
    out["lmc_decode_scaling_8_vs_1"] = _scaling(ours, "decode_tok_s")
    if compare_llamacpp:
        out["llamacpp_scaling_8_vs_1"] = _scaling(theirs)
        out["llamacpp_decode_scaling_8_vs_1"] = _scaling(theirs, "decode_tok_s")
    return out


def _fmt(v: float | None, fmt: str) -> str:
    return "-" if v is None else fmt.format(v)


def _ms(seconds: float | None, fmt: str) -> str:
    return _fmt(None if seconds is None else seconds * 1e3, fmt)


def format_table(r: dict[str, Any]) -> str:
    """One line per stream count and server: what the JSON says, for a reader."""
    head = ("streams", "server", "tok/s all", "decode tok/s", "tok/s each", "TTFT p50", "TTFT p99", "ITL p50",
            "vs llama.cpp")
    lines = [head]
    for row in r["rows"]:
        for name, key in (("lmc", "lmc"), ("llama.cpp", "llamacpp")):
            if key not in row:
                continue
            s = row[key] or {}                # None: llama.cpp's server did not start
            ratio = _fmt(row.get("ratio_aggregate"), "{:.2f}x") if key == "lmc" and "llamacpp" in row else ""
            lines.append((str(row["streams"]), name, _fmt(s.get("aggregate_tok_s"), "{:.1f}"),
                          _fmt(s.get("decode_tok_s"), "{:.1f}"), _fmt(s.get("per_stream_tok_s_p50"), "{:.1f}"),
                          _ms(s.get("ttft_p50_s"), "{:.0f} ms"), _ms(s.get("ttft_p99_s"), "{:.0f} ms"),
                          _ms(s.get("itl_p50_s"), "{:.1f} ms"), ratio))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = "\n".join("  ".join(c.rjust(w) if i != 1 else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths)))
                     .rstrip() for line in lines)
    notes = [(f"{r['model']}: {r['threads']} threads, --parallel {r['parallel']}, {r['prompt_tokens']}-word "
              f"prompts, {r['gen_tokens']} tokens per request (ignore_eos), context {r['ctx_per_request']} per "
              f"request")]
    if r.get("lmc_scaling_8_vs_1") is not None:
        notes.append(f"lmc serve, 8 streams vs 1: {r['lmc_scaling_8_vs_1']:.2f}x the tokens per second in all, "
                     f"{_fmt(r.get('lmc_decode_scaling_8_vs_1'), '{:.2f}x')} in decode")
    notes.append("tok/s all: completion tokens / wall time, prefill included; decode tok/s: streams / mean "
                 "time per output token after the first (TPOT)")
    if r.get("llamacpp_error"):
        notes.append(f"llama.cpp: {r['llamacpp_error']}")
    return "\n".join(notes[:1] + [text] + notes[1:])


def rounded(v: Any) -> Any:
    """Floats to 6 significant digits, all the way down: the JSON stays
    readable, and a time per output token of a few microseconds (a tiny
    model) keeps its digits, which 6 decimals would not."""
    if isinstance(v, float):
        return float(f"{v:.6g}") if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: rounded(x) for k, x in v.items()}
    if isinstance(v, list):
        return [rounded(x) for x in v]
    return v
