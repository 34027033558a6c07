"""Pre-rendered SSE events for the streamed chunks of the common case (no logprobs).

A streamed token costs one chunk, and the chunk's JSON is built on the event loop, which shares
the GIL with the engine thread: every microsecond spent here lengthens the engine's steps.
Building two pydantic models and serializing them per token cost ~30 us; a template costs
one `json` string escape and one f-string. The templates are rendered by pydantic itself, once
per request, with sentinel values cut out, so a chunk is byte for byte what
`ChatCompletionChunk(...).model_dump_json()` (or `CompletionResponse`) would write.
"""

from __future__ import annotations

import json

from pydantic import BaseModel

from splitphase.server.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
)

# Values no real chunk holds: an index and two private-use characters (pydantic writes them raw).
_INDEX = 987654321
_TEXT = "\ue000"
_REASON = "\ue001"
_quote = json.JSONEncoder(ensure_ascii=False).encode  # what pydantic writes for a str


class ChunkTemplate:
    """`data: {...}\\n\\n` of one chunk, with the choice index, text and finish reason filled in."""

    def __init__(self, sample: BaseModel) -> None:
        rendered = f"data: {sample.model_dump_json()}\n\n"
        head, rest = _cut(rendered, str(_INDEX))
        middle, rest = _cut(rest, _quote(_TEXT))
        before_reason, tail = _cut(rest, _quote(_REASON))
        self._head, self._middle = head, middle
        self._before_reason, self._tail = before_reason, tail

    def render(self, index: int, text: str, finish_reason: str | None) -> str:
        """The event for choice `index` carrying `text` (and its finish reason, if last)."""
        reason = "null" if finish_reason is None else _quote(finish_reason)
        return (f"{self._head}{index}{self._middle}{_quote(text)}{self._before_reason}{reason}"
                f"{self._tail}")


def _cut(rendered: str, sentinel: str) -> tuple[str, str]:
    # The last occurrence: the choice comes after `id` and `model`, which may hold anything.
    before, found, after = rendered.rpartition(sentinel)
    if not found:
        raise ValueError(f"the chunk schema changed: {sentinel!r} is not in it")
    return before, after


def completion_template(rid: str, created: int, model: str) -> ChunkTemplate:
    """A `text_completion` chunk of request `rid`."""
    choice = CompletionChoice(index=_INDEX, text=_TEXT, finish_reason=_REASON)
    return ChunkTemplate(CompletionResponse(id=rid, created=created, model=model,
                                            choices=[choice]))


def chat_template(rid: str, created: int, model: str, first: bool) -> ChunkTemplate:
    """A `chat.completion.chunk` of request `rid`; the first one of a choice names the role."""
    delta = ChatDelta(role="assistant" if first else None, content=_TEXT)
    choice = ChatChunkChoice(index=_INDEX, delta=delta, finish_reason=_REASON)
    return ChunkTemplate(ChatCompletionChunk(id=rid, created=created, model=model,
                                             choices=[choice]))
