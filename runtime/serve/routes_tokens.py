"""llama.cpp's tokenizer endpoints: /tokenize and /detokenize."""
from __future__ import annotations

from fastapi import APIRouter, Depends
from starlette.concurrency import run_in_threadpool

from . import schemas as S
from .backend import ServingBackend
from .errors import ApiError
from .generation import backend_of

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: S.TokenizeRequest, backend: ServingBackend = Depends(backend_of)) -> dict:
    ids = await run_in_threadpool(backend.tokenizer.encode, body.content, body.add_special, None, body.parse_special)
    return {"tokens": ids}


@router.post("/detokenize")
async def detokenize(body: S.DetokenizeRequest, backend: ServingBackend = Depends(backend_of)) -> dict:
    vocab = backend.info.vocab
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise ApiError(400, f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", "tokens")
    return {"content": await run_in_threadpool(backend.tokenizer.decode, body.tokens)}
