"""``POST /v1/chat/completions``: the model's chat template over the
messages, answered whole or streamed as server-sent events."""
from __future__ import annotations

import json
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from frontends.chat_template import ChatTemplateError

from ..context_shift import chat_keep

from . import schemas as S
from .backend import ServingBackend
from .errors import ApiError
from .tool_use import HeldText, ToolUse
from .generation import backend_of, check_model, events_of, finished, piece, sse, sse_error, start, usage_of, whole

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat(body: S.ChatRequest, backend: ServingBackend = Depends(backend_of)) -> Any:
    check_model(backend, body)
    if body.top_logprobs is not None and not body.logprobs:   # as OpenAI: not silently no log-probabilities
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    messages = [plain_message(m.model_dump(exclude_none=True)) for m in body.messages]
    calls = ToolUse.of(body, backend)
    kw = {}
    if calls is not None:
        messages, kw = calls.prompt(messages)
    try:
        ids = await run_in_threadpool(backend.tokenizer.chat_ids, messages, True, **kw)
    except (ChatTemplateError, ValueError) as e:
        raise ApiError(400, str(e), "messages") from None
    k = (body.top_logprobs or 0) if body.logprobs else None
    keep = None   # with --context-shift, a system prompt stays obeyed: its tokens are kept
    if backend.info.context_shift and body.n_keep is None and any(m.get("role") == "system" for m in messages):
        keep = await run_in_threadpool(chat_keep, backend.tokenizer, messages, kw.get("tools"))
    rid, events = await start(backend, ids, body, body.max_completion_tokens or body.max_tokens, k,
                              constraint=calls.constraint() if calls is not None else None, keep=keep)
    info = backend.info
    cid, model, created = f"chatcmpl-{rid}", body.model or info.model_id, info.created

    def logprobs(items: list) -> S.ChatLogprobs:
        out = []
        for lp in items:
            text, raw = piece(backend.tokenizer, lp.token)
            top = []
            for t, v in lp.top:
                tt, tb = piece(backend.tokenizer, t)
                top.append(S.TopLogprob(token=tt, logprob=v, bytes=tb))
            out.append(S.TokenLogprobOut(token=text, logprob=lp.logprob, bytes=raw, top_logprobs=top))
        return S.ChatLogprobs(content=out)

    if body.stream:
        usage_chunk = bool((body.stream_options or {}).get("include_usage"))

        async def stream() -> AsyncIterator[str]:
            yield sse(S.ChatCompletionChunk(id=cid, created=created, model=model,
                                            choices=[S.ChatChunkChoice(delta=S.ChatDelta(role="assistant",
                                                                                         content=""))]))
            held = HeldText(calls)
            async for ev in events_of(backend, rid, events):
                if ev.finish_reason == "error":
                    yield sse_error(ev)
                    break
                text, tool_calls, reason = held.feed(ev.text, ev.finish_reason)
                if text or reason or ev.logprobs:
                    yield sse(S.ChatCompletionChunk(
                        id=cid, created=created, model=model,
                        choices=[S.ChatChunkChoice(delta=S.ChatDelta(content=text or None),
                                                   logprobs=logprobs(ev.logprobs) if ev.logprobs else None,
                                                   finish_reason=None if tool_calls else reason)]))
                for i, call in enumerate(tool_calls):   # each call whole, keyed by its index
                    yield sse(S.ChatCompletionChunk(id=cid, created=created, model=model, choices=[
                        S.ChatChunkChoice(delta=S.ChatDelta(tool_calls=[call.openai(i)]))]))
                if tool_calls:
                    yield sse(S.ChatCompletionChunk(id=cid, created=created, model=model, choices=[
                        S.ChatChunkChoice(delta=S.ChatDelta(), finish_reason=reason)]))
                if ev.finish_reason and usage_chunk:
                    yield sse(S.ChatCompletionChunk(id=cid, created=created, model=model, choices=[],
                                                    usage=usage_of(ev)))
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")
    text, lps, last = await whole(backend, rid, events)
    reason = finished(last)
    content, tool_calls = (text, []) if calls is None else calls.read(text)
    if tool_calls and reason == "stop":
        reason = "tool_calls"
    message = S.AssistantMessage(content=content, tool_calls=[c.openai() for c in tool_calls] or None)
    out = S.ChatCompletion(id=cid, created=created, model=model, usage=usage_of(last), choices=[S.ChatChoice(
        message=message, finish_reason=reason,
        logprobs=logprobs(lps) if k is not None else None)]).model_dump(exclude_none=True)
    out["choices"][0]["message"].setdefault("content", None)   # OpenAI's null beside tool calls
    return out


def plain_message(m: dict) -> dict:
    """A message whose content is a list of parts (OpenAI's newer form) with
    its text parts joined: templates expect a string. Other parts (images,
    audio) are refused."""
    if m.get("role") == "developer":   # OpenAI's newer name for the system message; templates know system
        m = dict(m, role="system")
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
    if "tool_calls" in m and m["tool_calls"] is not None:
        calls = m["tool_calls"]
        if not isinstance(calls, list):
            raise ApiError(400, f"a message's tool_calls must be a list, not {type(calls).__name__}", "messages")
        # OpenAI sends arguments as JSON text; templates want the object
        m = dict(m, tool_calls=[_call_for_template(c) for c in calls])
    return m


def _call_for_template(call: Any) -> Any:
    """One assistant tool call as templates take it: OpenAI's
    {"type": "function", "function": {"name": str, "arguments": str}}."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
            or not isinstance(fn.get("arguments", "{}"), (str, dict)):
        raise ApiError(400, f"a tool call must be {{\"function\": {{\"name\": str, \"arguments\": str}}}}, "
                            f"got {json.dumps(call)[:120]}", "messages")
    if isinstance(fn.get("arguments"), str):
        try:
            args = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            raise ApiError(400, f"a tool call's arguments are not JSON: {fn['arguments'][:80]!r}",
                           "messages") from None
        return {**call, "function": {**fn, "arguments": args}}
    return call
