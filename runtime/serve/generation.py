"""What the two generation routes share: a request body becomes an engine
``Request``, its events come back through an asyncio queue (``start``,
``events_of``: a reader that leaves cancels it), and events become the
API's pieces (log-probabilities, usage, server-sent events)."""
from __future__ import annotations

import asyncio
import inspect
import json
import uuid
from typing import Any, AsyncIterator

from fastapi import Request as HttpRequest
from starlette.concurrency import run_in_threadpool

from .. import grammar as grammar_lib
from ..grammar import Constraint, GrammarMatcher

from ..engine import EngineBusy, EngineError, Event, Request
from ..sampling import SamplerConfig
from ..stop_strings import StopStringError, check_stops
from . import schemas as S
from .backend import ServingBackend
from .errors import ApiError


def backend_of(request: HttpRequest) -> ServingBackend:
    """The backend the app was assembled with (a route's dependency)."""
    return request.app.state.backend


def sampling_of(body: S.Sampling) -> SamplerConfig:
    bias = None
    if body.logit_bias:
        try:
            bias = {int(k): float(v) for k, v in body.logit_bias.items()}
        except ValueError:
            raise ApiError(400, "logit_bias maps token ids (as strings, \"1234\") to numbers", "logit_bias") from None
    config = SamplerConfig(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
                           repeat_penalty=body.repeat_penalty, presence_penalty=body.presence_penalty,
                           frequency_penalty=body.frequency_penalty, seed=body.seed, logit_bias=bias)
    try:
        config.validate()
    except ValueError as e:
        raise ApiError(400, str(e), "logit_bias" if "logit_bias" in str(e) else None) from None
    return config


def stops_of(body: S.Sampling) -> list[str]:
    try:
        return check_stops(body.stop)
    except StopStringError as e:
        raise ApiError(400, str(e), "stop") from None


def constraint_of(body: S.Sampling) -> Constraint | None:
    """What the body constrains the output to (``response_format``, or lmc's
    ``grammar`` / ``regex``), or None; a malformed one is a 400."""
    asked = [k for k in ("grammar", "regex") if getattr(body, k) is not None]
    rf = body.response_format
    kind = rf.get("type", "text") if isinstance(rf, dict) else None
    if rf is not None and kind != "text":
        asked.insert(0, "response_format")
    if len(asked) > 1:
        raise ApiError(400, f"{' and '.join(asked)}: ask for one constraint at most", asked[1])
    try:
        if body.grammar is not None:
            return grammar_lib.lark(body.grammar)
        if body.regex is not None:
            return grammar_lib.regex(body.regex)
        if rf is None or kind == "text":
            return None
        if kind == "json_object":
            return grammar_lib.json_object()
        if kind == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise ApiError(400, "response_format json_schema needs {\"json_schema\": {\"name\": ..., "
                               "\"schema\": {...}}}", "response_format")
            return grammar_lib.json_schema(spec["schema"])
    except grammar_lib.ConstraintError as e:
        raise ApiError(400, str(e), asked[0]) from None
    raise ApiError(400, f"response_format type {kind!r}: expected text, json_object or json_schema",
                   "response_format")


def matcher_of(backend: ServingBackend, constraint: Constraint) -> GrammarMatcher:
    """The request's own matcher (compiling the grammar: a 400 if it cannot be enforced)."""
    info = backend.info
    try:
        return GrammarMatcher(constraint, backend.tokenizer, info.stop_ids, info.vocab)
    except grammar_lib.ConstraintError as e:
        raise ApiError(400, str(e), constraint.param) from None


def check_model(backend: ServingBackend, body: S.Sampling) -> None:
    model_id = backend.info.model_id
    if body.model is not None and body.model not in (model_id, ""):
        raise ApiError(404, f"the model {body.model!r} does not exist; this server has {model_id!r}", "model",
                       kind="invalid_request_error", code="model_not_found")


async def start(backend: ServingBackend, ids: list[int], body: S.Sampling, max_tokens: int | None,
                logprobs: int | None, constraint: Constraint | None = None,
                keep: int | None = None) -> tuple[str, asyncio.Queue]:
    """Submit a request; its id and the queue its events arrive on. A
    request the backend refuses is an ApiError (400, or 503 when busy).
    ``constraint``: what the output follows, when the route decided it (a
    required tool call); else the body's own (``constraint_of``).
    ``keep``: with the server's context shift, the tokens each shift keeps
    when the body does not say (``n_keep``); None: 0."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    rid = uuid.uuid4().hex
    info = backend.info
    # without max_tokens a reply may run to the end of the context
    n = max_tokens if max_tokens is not None else max(1, info.ctx - len(ids))
    constraint = constraint or constraint_of(body)
    grammar = await run_in_threadpool(matcher_of, backend, constraint) if constraint is not None else None
    req = Request(ids, n, sampling_of(body), lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev),
                  stops_of(body), logprobs, rid, ignore_eos=body.ignore_eos,
                  lookup=info.lookup if body.lookup is None else body.lookup,
                  draft_max=info.draft_max if body.draft_max is None else body.draft_max, grammar=grammar,
                  keep=body.n_keep if body.n_keep is not None else keep or 0)
    try:
        submitted = backend.submit(req)
        if inspect.isawaitable(submitted):   # a backend in another process answers when the request is taken
            await submitted
    except EngineBusy as e:
        raise ApiError(503, f"{e}; try again shortly", kind="server_busy") from None
    except EngineError as e:
        param = next((p for p in ("logit_bias", "max_tokens") if p in str(e)), "messages")
        raise ApiError(400, str(e), param,
                       code="context_length_exceeded" if "context" in str(e) else None) from None
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    return rid, events


async def events_of(backend: ServingBackend, rid: str, events: asyncio.Queue) -> AsyncIterator[Event]:
    """The request's events until its finish; cancels it if the reader leaves."""
    done = False
    try:
        while not done:
            ev = await events.get()
            done = ev.finish_reason is not None
            yield ev
    finally:
        if not done:
            backend.cancel(rid)


async def whole(backend: ServingBackend, rid: str, events: asyncio.Queue) -> tuple[str, list, Event]:
    """A request's text, log-probabilities and last event, for an answer in one piece."""
    text, lps, last = "", [], None
    async for ev in events_of(backend, rid, events):
        text += ev.text
        lps += ev.logprobs or []
        last = ev
    return text, lps, last


def piece(tokenizer: Any, tok: int) -> tuple[str, list[int]]:
    """A token's text and bytes (control tokens spelled out)."""
    raw = tokenizer.token_to_piece(tok, special=True) if hasattr(tokenizer, "token_to_piece") else \
        tokenizer.decode([tok]).encode()
    return raw.decode("utf-8", errors="replace"), list(raw)


def usage_of(ev: Event) -> S.Usage:
    u = ev.usage or {}
    return S.Usage(prompt_tokens=u.get("prompt_tokens", 0), completion_tokens=u.get("completion_tokens", 0),
                   total_tokens=u.get("total_tokens", 0),
                   prompt_tokens_details={"cached_tokens": u.get("cached_tokens", 0)},
                   **{k: u[k] for k in ("context_shifts", "shifted_tokens") if k in u})


def finished(ev: Event) -> str:
    """The finish reason of a whole answer; an engine failure is a 500, a
    request's grammar its parser could not follow to the end a 400 naming it."""
    if ev.finish_reason == "error":
        if ev.error_param is not None:
            raise ApiError(400, ev.error or "the request failed", ev.error_param)
        raise ApiError(500, ev.error or "the engine failed", kind="server_error")
    return ev.finish_reason


def sse(model: S.BaseModel) -> str:
    return f"data: {model.model_dump_json(exclude_none=True)}\n\n"


def sse_error(ev: Event) -> str:
    """An engine failure in the middle of a stream: an error event."""
    kind = "server_error" if ev.error_param is None else "invalid_request_error"
    return f"data: {json.dumps({'error': {'message': ev.error, 'type': kind, 'param': ev.error_param}})}\n\n"
