"""Server-sent events: `data: {json}` chunks, an `error` event on failure, `data: [DONE]`.

`SSEResponse` always closes its generator and runs `on_close` when the response ends for any
reason (finished, client gone, server shutting down), which is what aborts the engine request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from splitphase.server.errors import APIError
from splitphase.server.generation import Generation

DONE = "data: [DONE]\n\n"


def sse(payload: BaseModel | dict[str, Any]) -> str:
    """One event."""
    text = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {text}\n\n"


def sse_error(error: APIError) -> str:
    """The `error` event a stream ends with when its request failed midway."""
    return sse(error.body())


class SSEResponse(StreamingResponse):
    """An event stream that cleans up after itself."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], Awaitable[None]],
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                  **(headers or {})})
        self._content = content
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self._content, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
            await self._on_close()


async def run_to_end(gen: Generation, request: Request, poll_s: float = 0.25) -> None:
    """Drain a generation for a non-streamed answer; abort it if the client disconnects."""

    async def drain() -> None:
        async for _ in gen.events():
            pass

    task = asyncio.create_task(drain())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                task.result()  # re-raises the generation's error
                return
            if await request.is_disconnected():
                raise APIError(499, "the client closed the connection")
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
