"""`POST /v1/completions`: text or token-id prompts, streaming or not, echo and logprobs.

Loglikelihood scoring (lm-evaluation-harness `local-completions`): token-id prompts with
`echo: true`, `logprobs: k` and `max_tokens` 1 (or 0: the prompt alone is scored; the engine
still samples one token, which is dropped from the answer).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from splitphase.server.chunks import completion_template
from splitphase.server.errors import APIError
from splitphase.server.generation import Event, Generation, map_engine_error
from splitphase.server.logprobs import (
    PromptLogprobs,
    TokenText,
    completion_logprobs,
    prompt_logprobs_complete,
)
from splitphase.server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Usage,
)
from splitphase.server.sampling import (
    check_context,
    checked_max_tokens,
    completion_prompts,
    sampling_params,
)
from splitphase.server.sse import DONE, SSEResponse, run_to_end, sse, sse_error
from splitphase.server.state import ServerState

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


@dataclass
class _Job:
    rid: str
    created: int
    model: str
    prompts: list[list[int]]
    texts: list[str]  # each prompt's text, for echo
    echo: bool
    score_only: bool  # max_tokens 0: the generated token is not part of the answer
    logprobs: int | None
    tokens: TokenText


async def create_completion(state: ServerState, body: CompletionRequest,
                            request: Request) -> Response:
    """Validate, admit, then answer with JSON or an event stream."""
    state.check_model(body.model)
    if body.suffix:
        raise APIError(400, "suffix is not supported; omit it", "suffix")
    seats = state.config.max_num_seqs + state.config.max_queue
    # Off the event loop: tokenizing a long prompt must not stall everyone else's streams.
    prompts = await asyncio.to_thread(completion_prompts, state.tokenizer, body.prompt,
                                      state.vocab_size, state.max_model_len, seats)
    echo = bool(body.echo)
    max_tokens = checked_max_tokens(body.max_tokens, DEFAULT_MAX_TOKENS, allow_zero=echo)
    params = sampling_params(body, max(1, max_tokens), body.logprobs, state.vocab_size)
    ids = [p for p, _ in prompts]
    check_context(ids, params.max_tokens, state.max_model_len)
    texts = [t if t is not None else state.tokenizer.decode(p) for p, t in prompts]
    job = _Job(f"cmpl-{uuid.uuid4().hex}", int(time.time()), state.config.model_id, ids, texts,
               echo, max_tokens == 0, body.logprobs, TokenText(state.tokenizer))
    want_prompt_lps = body.logprobs if echo and body.logprobs is not None else None
    gen = Generation(state, job.rid, ids, params, want_prompt_lps)
    gen.admit()
    request.state.splitphase = {"id": job.rid, "gen": gen}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return SSEResponse(_stream(state, job, gen, include_usage), on_close=gen.close,
                           headers={"X-Request-Id": job.rid})
    try:
        await run_to_end(gen, request)
    finally:
        await gen.close()
    response = await _response(state, job, gen)
    return JSONResponse(response.model_dump(), headers={"X-Request-Id": job.rid})


async def _response(state: ServerState, job: _Job, gen: Generation) -> CompletionResponse:
    choices = []
    completion_tokens = 0
    n = gen.params.n
    for i, out in enumerate(gen.finals()):
        p = i // n
        gen_ids = [] if job.score_only else out.token_ids
        completion_tokens += len(gen_ids)
        text = (job.texts[p] if job.echo else "") + ("" if job.score_only else out.text)
        logprobs = None
        if job.logprobs is not None:
            prompt_lps = await _prompt_logprobs(state, job, p, out.prompt_logprobs)
            logprobs = completion_logprobs(
                job.tokens, gen_ids, out.logprobs,
                prompt_ids=job.prompts[p] if job.echo else None, prompt_lps=prompt_lps,
            )
        choices.append(CompletionChoice(index=i, text=text, logprobs=logprobs,
                                        finish_reason=out.finish_reason))
    return CompletionResponse(id=job.rid, created=job.created, model=job.model, choices=choices,
                              usage=_usage(job, gen, completion_tokens))


async def _prompt_logprobs(state: ServerState, job: _Job, p: int,
                           got: PromptLogprobs | None) -> PromptLogprobs | None:
    """The engine's prompt logprobs (it computes every prompt position when they are asked)."""
    if not job.echo:
        return None
    if got is None or not prompt_logprobs_complete(job.prompts[p], got):
        message = "the engine returned incomplete prompt logprobs"
        raise APIError(500, message, code="prompt_logprobs")
    return got


def _usage(job: _Job, gen: Generation, completion_tokens: int) -> Usage:
    prompt_tokens = sum(len(p) for p in job.prompts)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens, timings=gen.timings())


async def _stream(state: ServerState, job: _Job, gen: Generation,
                  include_usage: bool) -> AsyncIterator[str]:
    completion_tokens = 0
    sent_chars: dict[int, int] = {}  # per choice: text_offset continues across chunks
    # Without logprobs a chunk is index, text and finish reason: fill a template (see chunks).
    fast = completion_template(job.rid, job.created, job.model) if job.logprobs is None \
        else None
    try:
        async for ev in gen.events():
            if fast is not None:
                completion_tokens += 0 if job.score_only else len(ev.new_token_ids)
                out = ev.output
                yield fast.render(ev.seq.index, _chunk_text(job, ev),
                                  out.finish_reason if out.finished else None)
                continue
            choice = await _chunk_choice(state, job, ev, sent_chars.get(ev.seq.index, 0))
            sent_chars[ev.seq.index] = sent_chars.get(ev.seq.index, 0) + len(choice.text)
            completion_tokens += 0 if job.score_only else len(ev.new_token_ids)
            yield sse(CompletionResponse(id=job.rid, created=job.created, model=job.model,
                                         choices=[choice]))
    except Exception as exc:  # the failure of a started stream is an `error` event
        yield sse_error(map_engine_error(exc))
        yield DONE
        return
    usage = _usage(job, gen, completion_tokens)
    if include_usage:
        yield sse(CompletionResponse(id=job.rid, created=job.created, model=job.model,
                                     choices=[], usage=usage))
    yield DONE


async def _chunk_choice(state: ServerState, job: _Job, ev: Event,
                        offset: int) -> CompletionChoice:
    p, out = ev.seq.prompt_index, ev.output
    new_ids = [] if job.score_only else ev.new_token_ids
    text = _chunk_text(job, ev)
    echo_now = job.echo and ev.first
    logprobs = None
    if job.logprobs is not None:
        prompt_lps = await _prompt_logprobs(state, job, p, out.prompt_logprobs) if echo_now \
            else None
        logprobs = completion_logprobs(
            job.tokens, new_ids, ev.new_logprobs[: len(new_ids)], offset,
            prompt_ids=job.prompts[p] if echo_now else None, prompt_lps=prompt_lps,
        )
    return CompletionChoice(index=ev.seq.index, text=text, logprobs=logprobs,
                            finish_reason=out.finish_reason if out.finished else None)



def _chunk_text(job: _Job, ev: Event) -> str:
    text = "" if job.score_only else ev.output.delta
    if job.echo and ev.first:  # the prompt rides on the first chunk, with the first token
        return job.texts[ev.seq.prompt_index] + text
    return text
