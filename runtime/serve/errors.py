"""Every refusal of the API is one JSON shape (OpenAI's error object) with
a 4xx status (503 when busy), and the server stays up."""
from __future__ import annotations

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from . import schemas as S
from .backend import ServingBackend

#: seconds a client told 503 (busy) should wait before trying again
RETRY_AFTER_S = 1


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code


def error_response(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                   code: str | None = None) -> JSONResponse:
    body = S.ErrorResponse(error=S.ErrorBody(message=message, type=kind, param=param, code=code))
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def install_error_handlers(app: FastAPI, backend: ServingBackend) -> None:
    """Our refusals, pydantic's and Starlette's (404, 405 ...) as one JSON shape, counted."""

    @app.exception_handler(ApiError)
    async def _api_error(_: HttpRequest, e: ApiError) -> JSONResponse:
        backend.count_error(e.status)
        return error_response(e.status, e.message, e.param, e.kind, e.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: HttpRequest, e: RequestValidationError) -> JSONResponse:
        backend.count_error(400)
        errs = e.errors()
        first = errs[0] if errs else {}
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":   # its loc is ("body", character offset): not a parameter
            at = next((x for x in first.get("loc", ()) if isinstance(x, int)), None)
            why = (first.get("ctx") or {}).get("error")
            detail = "" if at is None else f" (at character {at}: {why})" if why else f" (at character {at})"
            return error_response(400, "the body is not valid JSON" + detail)
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return error_response(400, f"{loc}: {msg}" if loc else msg, loc or None)

    @app.exception_handler(HTTPException)
    async def _http(_: HttpRequest, e: HTTPException) -> JSONResponse:
        backend.count_error(e.status_code)
        return error_response(e.status_code, str(e.detail), kind="not_found_error" if e.status_code == 404 else
                              "invalid_request_error")
