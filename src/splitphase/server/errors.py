"""Errors in the OpenAI shape `{"error": {"message", "type", "param", "code"}}`, never a trace.

Every failure a client can see goes through `APIError`; the exception handlers below map
FastAPI's validation errors, Starlette's 404/405 and anything unexpected into the same shape.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from splitphase.errors import UserError

log = logging.getLogger("splitphase.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error answer: HTTP status, a message that says what to change, and OpenAI fields."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON body (also the payload of an SSE `error` event)."""
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        """This error as an HTTP response."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """`{"error": {...}}` for a status."""
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_bytes(status: int, message: str, code: str | None = None) -> bytes:
    """The JSON body as bytes, for the raw ASGI middlewares."""
    return json.dumps(error_body(status, message, None, code)).encode()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 for an invalid field."""
    return APIError(400, message, param, code)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "the request body is invalid", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _is_type_tag(p)]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return f"the request body is not valid JSON ({detail})".replace(" ()", ""), None
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    where = f"{param}: " if param else "body: "
    message = f"{where}{first.get('msg', 'invalid value')}"
    if first.get("type") != "missing":
        got = first.get("input")
        shown = repr(got) if not isinstance(got, (dict, list)) else type(got).__name__
        message += f", got {shown[:100]}"
    return message + more, param


def _is_type_tag(part: object) -> bool:
    """pydantic names the union member in the location ("prompt.list[int].0"): drop it."""
    text = str(part)
    return text in ("str", "int", "float", "bool", "none") or text.startswith(("list[", "dict["))


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception a route can raise to the OpenAI error shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        # Wrong types are the client's to fix: 400 as OpenAI and vLLM answer, never a 422 trace.
        message, param = _validation_message(exc)
        return bad_request(message, param).response()

    @app.exception_handler(UserError)
    async def _user_error(request: Request, exc: UserError) -> JSONResponse:
        # Input the client can fix that only a deeper layer could judge (e.g. invalid Unicode).
        return bad_request(str(exc)).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = (
            f"no route {request.method} {request.url.path}"
            if exc.status_code in (404, 405)
            else str(exc.detail)
        )
        return APIError(exc.status_code, message).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal server error ({type(exc).__name__})").response()
