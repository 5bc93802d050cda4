"""``POST /v1/completions``: raw text (or token ids) continued, answered
whole or streamed as server-sent events."""
from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from . import schemas as S
from .backend import ServingBackend
from .errors import ApiError
from .generation import backend_of, check_model, events_of, finished, piece, sse, sse_error, start, usage_of, whole

router = APIRouter()


@router.post("/v1/completions")
async def completions(body: S.CompletionRequest, backend: ServingBackend = Depends(backend_of)) -> Any:
    check_model(backend, body)
    if body.echo:
        raise ApiError(400, "echo is not supported", "echo")
    if body.suffix:
        raise ApiError(400, "suffix (text after the insertion) is not supported", "suffix")
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise ApiError(400, "one prompt per request (n = 1)", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = await run_in_threadpool(backend.tokenizer.encode, prompt, True)
    else:
        ids = list(prompt)
    rid, events = await start(backend, ids, body, body.max_tokens, body.logprobs)
    info = backend.info
    cid, model, created = f"cmpl-{rid}", body.model or info.model_id, info.created
    offset = [0]

    def logprobs(items: list) -> S.CompletionLogprobs:
        toks, vals, tops, offs = [], [], [], []
        for lp in items:
            t = piece(backend.tokenizer, lp.token)[0]
            toks.append(t)
            vals.append(lp.logprob)
            tops.append({piece(backend.tokenizer, i)[0]: v for i, v in lp.top})
            offs.append(offset[0])
            offset[0] += len(t)
        return S.CompletionLogprobs(tokens=toks, token_logprobs=vals, top_logprobs=tops, text_offset=offs)

    if body.stream:
        async def stream() -> AsyncIterator[str]:
            async for ev in events_of(backend, rid, events):
                if ev.finish_reason == "error":
                    yield sse_error(ev)
                    break
                yield sse(S.Completion(id=cid, created=created, model=model, choices=[S.CompletionChoice(
                    text=ev.text, finish_reason=ev.finish_reason,
                    logprobs=logprobs(ev.logprobs) if ev.logprobs else None)],
                    usage=usage_of(ev) if ev.finish_reason else None))
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")
    text, lps, last = await whole(backend, rid, events)
    reason = finished(last)
    return S.Completion(id=cid, created=created, model=model, usage=usage_of(last), choices=[S.CompletionChoice(
        text=text, finish_reason=reason,
        logprobs=logprobs(lps) if body.logprobs is not None else None)]).model_dump(exclude_none=True)
