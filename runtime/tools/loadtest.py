"""The load generator (``lmc loadtest URL``): load an OpenAI-compatible server, report in one JSON object.

It measures what a user of a serving engine feels and what its operator
pays for, from the client's side, so the same numbers come out of ``lmc
serve`` and of llama.cpp's server: N clients, each streaming one request
after another (``stream: true`` with ``stream_options.include_usage``), until
M requests in all are done or the time bound runs out.

Per request it keeps the send time, the arrival time of every chunk with
non-empty text (time to first token; inter-token latency = the gaps between
successive such chunks), the usage (prompt and completion tokens: the
server's count, else the number of text chunks, which misses an
end-of-sequence token that brings no text) and the finish reason. An HTTP
error answer (4xx/5xx), an error event in the stream, a broken connection
or a stream that ends without a finish reason is an error of that request:
counted, its message kept (``"error_messages"``), the run goes on.
``"cached_prompt_tokens_total"`` (the usage's
``prompt_tokens_details.cached_tokens``) shows how much prefill a server's
prefix cache skipped: with the synthetic prompts, only a chat template's
opening.

``--ignore-eos`` (``ignore_eos=True``) asks the server to run every request
to ``max_tokens`` whatever the model samples (the ``ignore_eos`` field of
llama.cpp's server and vLLM, which lmc serve takes too): every request then
does the same work on every server, which a throughput comparison needs.

Percentiles are numpy's default, linear interpolation between the closest
ranks (``numpy.percentile(..., method="linear")``); with one sample every
percentile is that sample, with none they are null.

Exit status of the command: 0 when at least one request completed, 1 when
none did (all failed, or the time ran out first); 2 for a bad command line
or a server that cannot be reached at all (one line on stderr).
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


#: words of the synthetic prompts: plain English, about one token each in most vocabularies
WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
          "number group problem fact water room mother area money story month lot right study book job word "
          "house night home river city garden window door table friend morning music road paper light "
          "summer winter tree bird stone cloud forest").split()
DEFAULT_PROMPT_WORDS = 32


class ServerUnreachable(Exception):
    """The server at the URL cannot be reached at all (nothing to measure)."""


@dataclass
class RequestRecord:
    """One request's timings (``time.perf_counter`` seconds) and outcome."""

    sent: float
    chunks: list[float] = field(default_factory=list)   # arrival of each chunk with non-empty text
    end: float = 0.0
    completion_tokens: int | None = None                # the server's usage, when it sends one
    prompt_tokens: int | None = None
    cached_tokens: int | None = None                    # of the prompt, served from the server's prefix cache
    finish_reason: str | None = None
    error: str | None = None

    @property
    def tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else len(self.chunks)


def synthetic_prompt(words: int, rng: random.Random) -> str:
    """About ``words`` words, random from the first on: no two requests (of
    this run or an earlier one) share more than a token or two of prefix,
    so a server's prefix cache cannot skip their prefill. The instruction
    comes last for the same reason."""
    return " ".join(rng.choice(WORDS) for _ in range(words)) + ". Write a story with these words."


def _percentiles(xs: list[float], qs: tuple[int, ...]) -> dict[str, float | None]:
    import numpy as np

    if not xs:
        return {f"p{q}": None for q in qs}
    a = np.asarray(xs, np.float64)
    return {f"p{q}": float(np.percentile(a, q)) for q in qs}


def _error_text(status: int, body: bytes) -> str:
    """``"401 Invalid API Key"``: the status and the OpenAI-style error message (else the body's start)."""
    try:
        err = json.loads(body).get("error")
        msg = err.get("message") if isinstance(err, dict) else err
    except (ValueError, AttributeError):
        msg = None
    if not msg:
        msg = body.decode("utf-8", "replace").strip()[:200]
    return f"{status} {msg}".strip()


async def _stream_one(client: Any, path: str, body: dict, rec: RequestRecord) -> None:
    """POST one streaming request and fill ``rec`` from its server-sent events."""
    import httpx

    done = False
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code >= 400:
                rec.error = _error_text(resp.status_code, await resp.aread())
                return
            async for line in resp.aiter_lines():
                field_, _, data = line.partition(":")
                if field_ not in ("data", "error"):
                    continue                                   # blank separators, comments, "event:" lines
                data = data.strip()
                if data == "[DONE]":
                    done = True
                    break
                now = time.perf_counter()
                try:
                    ev = json.loads(data)
                except ValueError:
                    ev = None
                if not isinstance(ev, dict):
                    rec.error = f"not a JSON object in the stream: {data[:100]!r}"
                    return
                if field_ == "error" or ev.get("error"):   # llama.cpp: an "error: {...}" line; OpenAI: "error" key
                    e = ev.get("error", ev)
                    rec.error = f"error in the stream: {e.get('message', e) if isinstance(e, dict) else e}"
                    return
                for ch in ev.get("choices") or ():
                    delta = ch.get("delta") or {}
                    text = ch.get("text") or delta.get("content") or delta.get("reasoning_content")
                    if text:
                        rec.chunks.append(now)
                    if ch.get("finish_reason"):
                        rec.finish_reason = ch["finish_reason"]
                usage = ev.get("usage")
                if isinstance(usage, dict):
                    rec.completion_tokens = usage.get("completion_tokens", rec.completion_tokens)
                    rec.prompt_tokens = usage.get("prompt_tokens", rec.prompt_tokens)
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                    rec.cached_tokens = cached if cached is not None else rec.cached_tokens
    except httpx.HTTPError as e:
        rec.error = f"{type(e).__name__}: {e}".rstrip(": ")
        return
    finally:
        rec.end = time.perf_counter()
    if not done and rec.finish_reason is None:
        rec.error = "the stream ended without a finish reason or [DONE]"


def _normalize(url: str) -> str:
    """The server's base URL: ``http://`` when no scheme is given, without a
    trailing ``/`` or ``/v1`` (an OpenAI client's base_url works as well)."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url[:-3] if url.endswith("/v1") else url


async def load_test(url: str, clients: int = 4, requests: int | None = None, max_tokens: int = 64, *,
                    prompt: str | None = None, prompt_tokens: int | None = None, endpoint: str = "chat",
                    model: str | None = None, api_key: str | None = None, temperature: float = 0.0,
                    timeout: float = 600.0, details: bool = False, ignore_eos: bool = False) -> dict[str, Any]:
    """Run the load and return the report (the JSON object ``lmc loadtest`` prints).

    ``requests`` defaults to ``clients``; the prompt is ``prompt``, else a
    synthetic one of ``prompt_tokens`` (default 32) words per request;
    ``endpoint`` is ``"chat"`` or ``"completions"``; ``model`` defaults to
    the first id of ``GET /v1/models`` (left out of the requests when the
    server lists none). ``timeout`` bounds the whole run; what is in flight
    then is cancelled (``"cancelled"``) and ``"timed_out"`` is true.
    ``ignore_eos`` puts ``"ignore_eos": true`` in every request body.
    ``details`` adds ``"per_request"``: each finished request's numbers, in
    the order they finished. Raises ``ServerUnreachable`` when nothing
    answers at ``url``."""
    import httpx

    if endpoint not in ("chat", "completions"):
        raise ValueError(f"endpoint must be 'chat' or 'completions', not {endpoint!r}")
    requests = clients if requests is None else requests
    base = _normalize(url)
    deadline = time.perf_counter() + timeout
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=clients + 1, max_keepalive_connections=clients + 1)
    salt = random.getrandbits(64)
    recs: list[RequestRecord] = []
    in_flight = 0
    next_index = 0

    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=httpx.Timeout(timeout),
                                 limits=limits) as client:
        # the first contact: is anyone there, and which model is it (a 401 here leaves the model unknown;
        # the requests will then fail, and say why, one by one)
        try:
            r = await client.get("/v1/models", timeout=min(timeout, 30.0))
        except (httpx.TransportError, httpx.InvalidURL) as e:
            detail = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            raise ServerUnreachable(f"{url}: cannot connect ({detail})") from None
        if model is None and r.status_code == 200:
            try:
                model = r.json()["data"][0]["id"]
            except (ValueError, KeyError, IndexError, TypeError):
                pass

        def body(i: int) -> dict:
            text = prompt if prompt is not None else synthetic_prompt(
                prompt_tokens or DEFAULT_PROMPT_WORDS, random.Random(f"{salt}:{i}"))
            b: dict[str, Any] = {"max_tokens": max_tokens, "temperature": temperature, "stream": True,
                                 "stream_options": {"include_usage": True}}
            if model is not None:
                b["model"] = model
            if ignore_eos:
                b["ignore_eos"] = True
            if endpoint == "chat":
                b["messages"] = [{"role": "user", "content": text}]
            else:
                b["prompt"] = text
            return b

        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"

        async def client_loop() -> None:
            nonlocal in_flight, next_index
            while next_index < requests:
                i = next_index
                next_index += 1
                rec = RequestRecord(sent=time.perf_counter())
                in_flight += 1
                await _stream_one(client, path, body(i), rec)   # a cancel here drops rec: not finished
                in_flight -= 1
                recs.append(rec)

        tasks = [asyncio.create_task(client_loop()) for _ in range(min(clients, requests))]
        try:
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
        finally:   # also when the run itself is cancelled (Ctrl-C): no client outlives the connections
            for t in tasks:
                t.cancel()                                 # a no-op on the finished ones
            await asyncio.gather(*tasks, return_exceptions=True)
        for t in tasks:
            if not t.cancelled() and t.exception() is not None:
                raise t.exception()

    report = _report(base, model, endpoint, clients, requests, max_tokens, recs, timed_out=bool(pending),
                     cancelled=in_flight)
    report["ignore_eos"] = ignore_eos
    if details:
        report["per_request"] = [
            {"ttft_s": r.chunks[0] - r.sent if r.chunks else None, "text_chunks": len(r.chunks),
             "usage_completion_tokens": r.completion_tokens, "prompt_tokens": r.prompt_tokens,
             "cached_tokens": r.cached_tokens,
             "finish_reason": r.finish_reason, "error": r.error, "latency_s": r.end - r.sent} for r in recs]
    return report


def _report(url: str, model: str | None, endpoint: str, clients: int, requests: int, max_tokens: int,
            recs: list[RequestRecord], timed_out: bool, cancelled: int) -> dict[str, Any]:
    import numpy as np

    ok = [r for r in recs if r.error is None]
    first = min((r.sent for r in recs), default=0.0)
    wall = max((r.end for r in recs), default=first) - first
    ttft = [r.chunks[0] - r.sent for r in ok if r.chunks]
    itl = [b - a for r in ok for a, b in zip(r.chunks, r.chunks[1:])]
    per_stream = [(r.tokens - 1) / (r.chunks[-1] - r.chunks[0]) for r in ok
                  if len(r.chunks) >= 2 and r.chunks[-1] > r.chunks[0]]
    tpot = [1.0 / v for v in per_stream]     # time per output token after the first (vLLM's TPOT)
    completion = sum(r.tokens for r in ok)
    prompt_counts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    cached_counts = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    return {
        "url": url, "model": model, "endpoint": endpoint, "clients": clients, "requests": requests,
        "completed": len(ok), "errors": len(recs) - len(ok), "cancelled": cancelled, "max_tokens": max_tokens,
        "wall_s": wall,
        "ttft_s": {**_percentiles(ttft, (50, 90, 99)), "mean": float(np.mean(ttft)) if ttft else None},
        "itl_s": _percentiles(itl, (50, 90, 99)),
        "aggregate_tok_s": completion / wall if wall > 0 else None,
        "per_stream_tok_s": _percentiles(per_stream, (50,)),
        "tpot_s": {**_percentiles(tpot, (50,)), "mean": float(np.mean(tpot)) if tpot else None},
        # what the server delivers while every client is decoding: clients / mean TPOT
        "decode_tok_s": min(clients, requests) / float(np.mean(tpot)) if tpot else None,
        "prompt_tokens_total": sum(prompt_counts) if prompt_counts else None,
        "cached_prompt_tokens_total": sum(cached_counts) if cached_counts else None,
        "completion_tokens_total": completion,
        "finish_reasons": dict(Counter(r.finish_reason or "none" for r in ok)),
        "error_messages": dict(Counter(r.error for r in recs if r.error is not None).most_common(10)),
        "timed_out": timed_out,
    }


def run_load_test(url: str, clients: int = 4, requests: int | None = None, max_tokens: int = 64,
                  **kwargs: Any) -> dict[str, Any]:
    """``load_test`` for callers without an event loop (tests, benchmarks)."""
    return asyncio.run(load_test(url, clients, requests, max_tokens, **kwargs))
