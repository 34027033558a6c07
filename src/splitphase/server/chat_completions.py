"""`POST /v1/chat/completions`: messages through the chat template, streaming or not."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from splitphase.engine.sampling_params import MAX_LOGPROBS
from splitphase.server.chat import message_dicts
from splitphase.server.chunks import chat_template
from splitphase.server.errors import bad_request
from splitphase.server.generation import Event, Generation, map_engine_error
from splitphase.server.logprobs import TokenText, chat_logprobs
from splitphase.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    Usage,
)
from splitphase.server.sampling import (
    check_context,
    check_text_fits,
    checked_max_tokens,
    sampling_params,
)
from splitphase.server.sse import DONE, SSEResponse, run_to_end, sse, sse_error
from splitphase.server.state import ServerState


def _top_logprobs(body: ChatCompletionRequest) -> int | None:
    """Engine logprobs for chat: None, or the number of alternatives (0 = the token only)."""
    top = body.top_logprobs
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}",
                          "top_logprobs")
    if not body.logprobs:
        if top:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        return None
    return top or 0


def _check_unsupported(body: ChatCompletionRequest) -> None:
    if body.tools:
        raise bad_request("tools are not supported by this server; omit them", "tools")
    fmt = (body.response_format or {}).get("type", "text")
    if fmt != "text":
        raise bad_request(f"response_format {fmt!r} is not supported; only 'text'",
                          "response_format")


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest,
                                 request: Request) -> Response:
    """Validate, render the template, admit, then answer with JSON or an event stream."""
    state.check_model(body.model)
    _check_unsupported(body)
    messages = message_dicts(body.messages)
    check_text_fits(state.tokenizer, "".join(m["content"] for m in messages),
                    state.max_model_len, "messages")
    # Off the event loop: tokenizing long messages must not stall everyone else's streams.
    ids = await asyncio.to_thread(state.chat.encode, messages,
                                  body.add_generation_prompt is not False)
    room = state.max_model_len - len(ids)
    wanted = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = checked_max_tokens(wanted, max(1, room), name)
    top = _top_logprobs(body)
    params = sampling_params(body, max_tokens, top, state.vocab_size,
                             state.chat.stop_token_ids())
    check_context([ids], params.max_tokens, state.max_model_len, "messages")
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    gen = Generation(state, rid, [ids], params)
    gen.admit()
    request.state.splitphase = {"id": rid, "gen": gen}
    created, model = int(time.time()), state.config.model_id
    tokens = TokenText(state.tokenizer)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = _stream(gen, rid, created, model, tokens, top, include_usage)
        return SSEResponse(chunks, on_close=gen.close, headers={"X-Request-Id": rid})
    try:
        await run_to_end(gen, request)
    finally:
        await gen.close()
    choices = []
    for i, out in enumerate(gen.finals()):
        lps = chat_logprobs(tokens, out.token_ids, out.logprobs, top) if top is not None \
            else None
        choices.append(ChatChoice(index=i, message=ChatResponseMessage(content=out.text),
                                  logprobs=lps, finish_reason=out.finish_reason))
    usage = _usage(gen)
    response = ChatCompletionResponse(id=rid, created=created, model=model, choices=choices,
                                      usage=usage)
    return JSONResponse(response.model_dump(), headers={"X-Request-Id": rid})


def _usage(gen: Generation, completion_tokens: int | None = None) -> Usage:
    prompt_tokens = len(gen.prompts[0])
    if completion_tokens is None:
        completion_tokens = sum(len(o.token_ids) for o in gen.finals())
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens, timings=gen.timings())


async def _stream(gen: Generation, rid: str, created: int, model: str, tokens: TokenText,
                  top: int | None, include_usage: bool) -> AsyncIterator[str]:
    completion_tokens = 0
    # Without logprobs a chunk is index, text and finish reason: fill a template (see chunks).
    fast = (chat_template(rid, created, model, first=True),
            chat_template(rid, created, model, first=False)) if top is None else None
    try:
        async for ev in gen.events():
            completion_tokens += len(ev.new_token_ids)
            out = ev.output
            if fast is not None:
                yield fast[0 if ev.first else 1].render(
                    ev.seq.index, out.delta, out.finish_reason if out.finished else None)
                continue
            choice = _chunk_choice(ev, tokens, top)
            yield sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=[choice]))
    except Exception as exc:  # the failure of a started stream is an `error` event
        yield sse_error(map_engine_error(exc))
        yield DONE
        return
    usage = _usage(gen, completion_tokens)
    if include_usage:
        yield sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=[],
                                      usage=usage))
    yield DONE


def _chunk_choice(ev: Event, tokens: TokenText, top: int | None) -> ChatChunkChoice:
    out = ev.output
    # The first chunk names the role and already carries the first token (honest client TTFT).
    delta = ChatDelta(role="assistant" if ev.first else None, content=out.delta)
    lps = chat_logprobs(tokens, ev.new_token_ids, ev.new_logprobs, top) if top is not None \
        else None
    return ChatChunkChoice(index=ev.seq.index, delta=delta, logprobs=lps,
                           finish_reason=out.finish_reason if out.finished else None)
