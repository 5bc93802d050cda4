"""The HTTP side: an OpenAI-compatible API on FastAPI, talking to the engine thread.

Each request is rendered (chat template) and tokenized off the event loop,
handed to the engine (``runtime.engine.Engine``) with a callback that
puts its events on an asyncio queue, and answered whole or streamed as
server-sent events ending in ``data: [DONE]``. A client that goes away
cancels its request and frees its KV blocks. Every refusal is a 4xx with an
OpenAI-style JSON error, and the server stays up.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from ..sampling import SamplerConfig
from ..engine import Engine, EngineBusy, EngineError, Event, Request
from ..speculative import DEFAULT_DRAFT_MAX
from ..stop_strings import StopStringError, check_stops
from . import schemas as S
from .metrics import ServerMetrics

#: request bodies larger than this are refused (413) before they are read whole
MAX_BODY_BYTES = 8 << 20


#: seconds a client told 503 (busy) should wait before trying again
RETRY_AFTER_S = 1


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
           code: str | None = None) -> JSONResponse:
    body = S.ErrorResponse(error=S.ErrorBody(message=message, type=kind, param=param, code=code))
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def create_app(engine: Engine, tokenizer: Any, model_id: str, ctx: int, api_key: str | None = None,
               metrics: ServerMetrics | None = None, model_meta: dict | None = None,
               lookup: int = 0, draft_max: int = DEFAULT_DRAFT_MAX) -> FastAPI:
    """The API for ``engine``'s model, named ``model_id`` on /v1/models;
    ``lookup``/``draft_max``: speculation for requests that do not say (the
    n-gram length of prompt lookup, 0 for the engine's drafter if any; the
    tokens drafted per step at most)."""
    app = FastAPI(title="lmc", docs_url=None, redoc_url=None)
    created = int(time.time())
    metrics = metrics or ServerMetrics()

    # --- errors: one JSON shape, the server stays up ------------------------------------------
    @app.exception_handler(ApiError)
    async def _api_error(_: HttpRequest, e: ApiError) -> JSONResponse:
        metrics.http_errors.labels(str(e.status)).inc()
        return _error(e.status, e.message, e.param, e.kind, e.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: HttpRequest, e: RequestValidationError) -> JSONResponse:
        metrics.http_errors.labels("400").inc()
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        msg = first.get("msg", "invalid request")
        return _error(400, f"{loc}: {msg}" if loc else msg, loc or None)

    @app.exception_handler(HTTPException)
    async def _http(_: HttpRequest, e: HTTPException) -> JSONResponse:
        metrics.http_errors.labels(str(e.status_code)).inc()
        return _error(e.status_code, str(e.detail), kind="not_found_error" if e.status_code == 404 else
                      "invalid_request_error")

    @app.middleware("http")
    async def _guard(request: HttpRequest, call_next: Callable) -> Response:
        size = request.headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > MAX_BODY_BYTES):
            metrics.http_errors.labels("413").inc()
            return _error(413, f"the request body is larger than {MAX_BODY_BYTES >> 20} MiB")
        if api_key is not None and request.url.path != "/health":
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                metrics.http_errors.labels("401").inc()
                return _error(401, "invalid or missing API key (Authorization: Bearer KEY)",
                              kind="authentication_error")
        return await call_next(request)

    # --- plain endpoints ---------------------------------------------------------------------
    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> S.ModelList:
        return S.ModelList(data=[S.ModelCard(id=model_id, created=created, meta=model_meta)])

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(body: S.TokenizeRequest) -> dict:
        ids = await run_in_threadpool(tokenizer.encode, body.content, body.add_special, None, body.parse_special)
        return {"tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: S.DetokenizeRequest) -> dict:
        bad = [t for t in body.tokens if not 0 <= t < engine.vocab]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside the vocabulary (0..{engine.vocab - 1})", "tokens")
        return {"content": await run_in_threadpool(tokenizer.decode, body.tokens)}

    # --- generation ----------------------------------------------------------------------------
    def sampling_of(body: S.Sampling) -> SamplerConfig:
        return SamplerConfig(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
                             repeat_penalty=body.repeat_penalty, presence_penalty=body.presence_penalty,
                             frequency_penalty=body.frequency_penalty, seed=body.seed)

    def stops_of(body: S.Sampling) -> list[str]:
        try:
            return check_stops(body.stop)
        except StopStringError as e:
            raise ApiError(400, str(e), "stop") from None

    def check_model(body: S.Sampling) -> None:
        if body.model is not None and body.model not in (model_id, ""):
            raise ApiError(404, f"the model {body.model!r} does not exist; this server has {model_id!r}", "model",
                           kind="invalid_request_error", code="model_not_found")

    async def start(ids: list[int], body: S.Sampling, max_tokens: int | None, logprobs: int | None
                    ) -> tuple[str, asyncio.Queue]:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        rid = uuid.uuid4().hex
        # without max_tokens a reply may run to the end of the context
        n = max_tokens if max_tokens is not None else max(1, ctx - len(ids))
        req = Request(ids, n, sampling_of(body), lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev),
                      stops_of(body), logprobs, rid, ignore_eos=body.ignore_eos,
                      lookup=lookup if body.lookup is None else body.lookup,
                      draft_max=draft_max if body.draft_max is None else body.draft_max)
        try:
            engine.submit(req)
        except EngineBusy as e:
            raise ApiError(503, f"{e}; try again shortly", kind="server_busy") from None
        except EngineError as e:
            raise ApiError(400, str(e), "max_tokens" if "max_tokens" in str(e) else "messages",
                           code="context_length_exceeded" if "context" in str(e) else None) from None
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        return rid, events

    async def events_of(rid: str, events: asyncio.Queue) -> AsyncIterator[Event]:
        """The request's events until its finish; cancels it if the reader leaves."""
        done = False
        try:
            while not done:
                ev = await events.get()
                done = ev.finish_reason is not None
                yield ev
        finally:
            if not done:
                engine.cancel(rid)

    async def whole(rid: str, events: asyncio.Queue) -> tuple[str, list, Event]:
        """A request's text, log-probabilities and last event, for an answer in one piece."""
        text, lps, last = "", [], None
        async for ev in events_of(rid, events):
            text += ev.text
            lps += ev.logprobs or []
            last = ev
        return text, lps, last

    def piece(tok: int) -> tuple[str, list[int]]:
        raw = tokenizer.token_to_piece(tok, special=True) if hasattr(tokenizer, "token_to_piece") else \
            tokenizer.decode([tok]).encode()
        return raw.decode("utf-8", errors="replace"), list(raw)

    def chat_logprobs(items: list) -> S.ChatLogprobs:
        out = []
        for lp in items:
            text, raw = piece(lp.token)
            top = []
            for t, v in lp.top:
                tt, tb = piece(t)
                top.append(S.TopLogprob(token=tt, logprob=v, bytes=tb))
            out.append(S.TokenLogprobOut(token=text, logprob=lp.logprob, bytes=raw, top_logprobs=top))
        return S.ChatLogprobs(content=out)

    def usage_of(ev: Event) -> S.Usage:
        u = ev.usage or {}
        return S.Usage(prompt_tokens=u.get("prompt_tokens", 0), completion_tokens=u.get("completion_tokens", 0),
                       total_tokens=u.get("total_tokens", 0),
                       prompt_tokens_details={"cached_tokens": u.get("cached_tokens", 0)})

    def finished(ev: Event) -> str:
        if ev.finish_reason == "error":
            raise ApiError(500, ev.error or "the engine failed", kind="server_error")
        return ev.finish_reason

    def sse(model: S.BaseModel) -> str:
        return f"data: {model.model_dump_json(exclude_none=True)}\n\n"

    @app.post("/v1/chat/completions")
    async def chat(body: S.ChatRequest) -> Any:
        from frontends.chat_template import ChatTemplateError

        check_model(body)
        if body.response_format is not None and body.response_format.get("type", "text") != "text":
            raise ApiError(400, "response_format other than text is not supported", "response_format")
        messages = [plain_message(m.model_dump(exclude_none=True)) for m in body.messages]
        kw = {"tools": body.tools} if body.tools else {}
        try:
            ids = await run_in_threadpool(tokenizer.chat_ids, messages, True, **kw)
        except (ChatTemplateError, ValueError) as e:
            raise ApiError(400, str(e), "messages") from None
        k = (body.top_logprobs or 0) if body.logprobs else None
        rid, events = await start(ids, body, body.max_completion_tokens or body.max_tokens, k)
        cid, model = f"chatcmpl-{rid}", body.model or model_id
        if body.stream:
            usage_chunk = bool((body.stream_options or {}).get("include_usage"))

            async def stream() -> AsyncIterator[str]:
                yield sse(S.ChatCompletionChunk(id=cid, created=created, model=model,
                                                choices=[S.ChatChunkChoice(delta=S.ChatDelta(role="assistant",
                                                                                             content=""))]))
                async for ev in events_of(rid, events):
                    if ev.finish_reason == "error":
                        yield f"data: {json.dumps({'error': {'message': ev.error, 'type': 'server_error'}})}\n\n"
                        break
                    if ev.text or ev.finish_reason or ev.logprobs:
                        yield sse(S.ChatCompletionChunk(
                            id=cid, created=created, model=model,
                            choices=[S.ChatChunkChoice(delta=S.ChatDelta(content=ev.text or None),
                                                       logprobs=chat_logprobs(ev.logprobs) if ev.logprobs else None,
                                                       finish_reason=ev.finish_reason)]))
                    if ev.finish_reason and usage_chunk:
                        yield sse(S.ChatCompletionChunk(id=cid, created=created, model=model, choices=[],
                                                        usage=usage_of(ev)))
                yield "data: [DONE]\n\n"

            return StreamingResponse(stream(), media_type="text/event-stream")
        text, lps, last = await whole(rid, events)
        reason = finished(last)
        return S.ChatCompletion(id=cid, created=created, model=model, usage=usage_of(last), choices=[S.ChatChoice(
            message=S.AssistantMessage(content=text), finish_reason=reason,
            logprobs=chat_logprobs(lps) if k is not None else None)]).model_dump(exclude_none=True)

    @app.post("/v1/completions")
    async def completions(body: S.CompletionRequest) -> Any:
        check_model(body)
        if body.echo:
            raise ApiError(400, "echo is not supported", "echo")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ApiError(400, "one prompt per request (n = 1)", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = await run_in_threadpool(tokenizer.encode, prompt, True)
        else:
            ids = list(prompt)
        rid, events = await start(ids, body, body.max_tokens, body.logprobs)
        cid, model = f"cmpl-{rid}", body.model or model_id
        offset = [0]

        def logprobs(items: list) -> S.CompletionLogprobs:
            toks, vals, tops, offs = [], [], [], []
            for lp in items:
                t = piece(lp.token)[0]
                toks.append(t)
                vals.append(lp.logprob)
                tops.append({piece(i)[0]: v for i, v in lp.top})
                offs.append(offset[0])
                offset[0] += len(t)
            return S.CompletionLogprobs(tokens=toks, token_logprobs=vals, top_logprobs=tops, text_offset=offs)

        if body.stream:
            async def stream() -> AsyncIterator[str]:
                async for ev in events_of(rid, events):
                    if ev.finish_reason == "error":
                        yield f"data: {json.dumps({'error': {'message': ev.error, 'type': 'server_error'}})}\n\n"
                        break
                    yield sse(S.Completion(id=cid, created=created, model=model, choices=[S.CompletionChoice(
                        text=ev.text, finish_reason=ev.finish_reason,
                        logprobs=logprobs(ev.logprobs) if ev.logprobs else None)],
                        usage=usage_of(ev) if ev.finish_reason else None))
                yield "data: [DONE]\n\n"

            return StreamingResponse(stream(), media_type="text/event-stream")
        text, lps, last = await whole(rid, events)
        reason = finished(last)
        return S.Completion(id=cid, created=created, model=model, usage=usage_of(last), choices=[S.CompletionChoice(
            text=text, finish_reason=reason,
            logprobs=logprobs(lps) if body.logprobs is not None else None)]).model_dump(exclude_none=True)

    return app


def plain_message(m: dict) -> dict:
    """A message whose content is a list of parts (OpenAI's newer form) with
    its text parts joined: templates expect a string. Other parts (images,
    audio) are refused."""
    content = m.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ApiError(400, f"message content part of type {kind!r}: only text parts are supported",
                               "messages")
            texts.append(part["text"])
        m = dict(m, content="".join(texts))
    return m
