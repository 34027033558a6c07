"""Step outputs over the engine core's pipe as deltas, rebuilt whole on the other side.

A `RequestOutput` is cumulative: its token ids, text and logprobs so far, and its `Request`
(prompt ids, every token's time). Pickling all of it every step costs O(length) per request
per step, on the core's critical path. The core sends what is new instead (`OutputDelta`);
the API side keeps each request's running totals and rebuilds the same `RequestOutput`s.
The `Request` travels on a request's first output and on its last (the server reads its
timings there); in between the receiver keeps the first one, so its counters stay as they
were at the first token until the request finishes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from splitphase.engine.llm_engine import RequestOutput
from splitphase.engine.request import Request
from splitphase.engine.sampler import SampledToken

PromptLogprobs = list[tuple[float, tuple[tuple[int, float], ...]]]


class OutputDelta(NamedTuple):
    """What one output adds to the ones sent before it."""

    request_id: str
    prompt_token_ids: list[int] | None  # on the first output only
    new_token_ids: list[int]
    delta: str
    new_logprobs: list[SampledToken]
    finished: bool
    finish_reason: str | None
    prompt_logprobs: PromptLogprobs | None  # when it grew (it fills during prefill)
    request: Request | None  # on the first and the last output


@dataclass
class _Sent:
    tokens: int = 0
    prompt_logprobs: int = -1  # length sent; -1: none yet


class DeltaEncoder:
    """Core side: each output as a delta against what this encoder sent for its request."""

    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}

    def encode(self, out: RequestOutput) -> OutputDelta:
        first = out.request_id not in self._sent
        sent = self._sent.setdefault(out.request_id, _Sent())
        plp = out.prompt_logprobs
        new_plp = plp is not None and len(plp) != sent.prompt_logprobs
        delta = OutputDelta(
            out.request_id,
            out.prompt_token_ids if first else None,
            out.token_ids[sent.tokens :],
            out.delta,
            out.logprobs[sent.tokens :] if out.logprobs else [],
            out.finished,
            out.finish_reason,
            plp if new_plp else None,
            out.request if first or out.finished else None,
        )
        sent.tokens = len(out.token_ids)
        if plp is not None:
            sent.prompt_logprobs = len(plp)
        if out.finished:
            del self._sent[out.request_id]
        return delta


@dataclass
class _Totals:
    prompt_token_ids: list[int]
    request: Request | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[SampledToken] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None


class DeltaDecoder:
    """API side: running totals per request; each delta back into a whole RequestOutput."""

    def __init__(self) -> None:
        self._totals: dict[str, _Totals] = {}

    def decode(self, d: OutputDelta) -> RequestOutput:
        t = self._totals.get(d.request_id)
        if t is None:
            t = self._totals[d.request_id] = _Totals(d.prompt_token_ids or [], d.request)
        t.token_ids += d.new_token_ids
        t.text += d.delta
        t.logprobs += d.new_logprobs
        if d.prompt_logprobs is not None:
            t.prompt_logprobs = d.prompt_logprobs
        if d.request is not None:
            t.request = d.request
        if d.finished:
            del self._totals[d.request_id]
        return RequestOutput(d.request_id, t.prompt_token_ids, list(t.token_ids), t.text,
                             d.delta, d.finished, d.finish_reason, list(t.logprobs),
                             t.prompt_logprobs, t.request)
