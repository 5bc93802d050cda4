"""The plain endpoints: health, the model list, Prometheus metrics."""
from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from . import schemas as S
from .backend import ServingBackend
from .generation import backend_of

router = APIRouter()


@router.get("/health")
async def health() -> dict:
    return {"status": "ok"}


@router.get("/v1/models")
async def models(backend: ServingBackend = Depends(backend_of)) -> S.ModelList:
    info = backend.info
    return S.ModelList(data=[S.ModelCard(id=info.model_id, created=info.created, meta=info.meta)])


@router.get("/metrics")
async def prometheus(backend: ServingBackend = Depends(backend_of)) -> Response:
    return Response(backend.metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8")
