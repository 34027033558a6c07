"""Raw ASGI middlewares: the request log line, the API key, the body size limit.

They run before any JSON parsing, so a 401 or a 413 costs no parse, and they see the whole
life of a response (streams included), so the log line is written when the stream ends.
"""

from __future__ import annotations

import hmac
import logging
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from splitphase.server.errors import error_bytes

log = logging.getLogger("splitphase.server")
OPEN_PATHS = ("/health", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")
QUIET_PATHS = ("/health", "/metrics")  # scraped every few seconds: debug level only
_BODY_METHODS = ("POST", "PUT", "PATCH")


async def send_error(send: Send, status: int, message: str, code: str | None = None,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """Answer with an OpenAI-shaped JSON error straight from ASGI."""
    body = error_bytes(status, message, code)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value)
    return None


class RequestLog:
    """One line per request: id, status, prompt/output tokens, TTFT, TPOT (never a secret)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start_s = time.perf_counter()
        status = {"code": 0}

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self._log(scope, status["code"] or 500, time.perf_counter() - start_s)

    @staticmethod
    def _log(scope: Scope, status: int, wall_s: float) -> None:
        path = scope.get("path", "")
        level = logging.DEBUG if path in QUIET_PATHS and status < 400 else logging.INFO
        if not log.isEnabledFor(level):
            return
        info: dict[str, Any] = (scope.get("state") or {}).get("splitphase") or {}
        parts = [scope.get("method", "?"), path, str(info.get("id", "-")), str(status)]
        gen = info.get("gen")
        if gen is not None:
            t = gen.timings()
            parts += [f"prompt_tokens={gen.prompt_tokens}", f"output_tokens={gen.output_tokens}",
                      f"finish={gen.finish_reason()}", f"ttft_ms={_ms(t.ttft_s)}",
                      f"tpot_ms={_ms(t.tpot_s)}"]
        parts.append(f"wall_ms={wall_s * 1e3:.1f}")
        log.log(level, " ".join(parts))


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


class ApiKey:
    """401 unless `Authorization: Bearer KEY` matches (constant time); /health stays open."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app, self._key = app, key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path") not in OPEN_PATHS:
            auth = _header(scope, b"authorization") or b""
            token = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self._key):
                why = "missing" if not token else "wrong"
                await send_error(send, 401, f"{why} API key: send 'Authorization: Bearer KEY'",
                                 "invalid_api_key", [(b"www-authenticate", b"Bearer")])
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """413 for a body over `max_bytes`, by Content-Length or while reading, before parsing."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(send, int(declared))
            return
        chunks, size = [], 0
        while True:  # bodies are small (<= max_bytes): read it all, then replay it
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(send, size)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False
        # Every POST route here takes JSON only: read any body as JSON (`curl -d` says form).
        headers = [(k, v) for k, v in scope.get("headers", ()) if k.lower() != b"content-type"]
        scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # afterwards: the client's disconnect, for streams

        await self.app(scope, replay, send)

    async def _too_large(self, send: Send, size: int) -> None:
        await send_error(send, 413, f"the request body has {size} bytes (or more); the limit "
                         f"is {self.max_bytes} bytes", "request_too_large")
