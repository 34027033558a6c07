"""One HTTP request's engine work: its prompts times `n` sequences, merged as tokens arrive.

Admission happens before a response starts (so a full queue is a real 429, not an SSE error);
`close()` always runs (the response wrapper calls it) and aborts whatever is unfinished, so a
client that goes away frees its KV blocks before the engine's next step.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

from splitphase.engine.async_engine import EngineDeadError, EngineStepError
from splitphase.engine.disagg_config import WorkerDiedError
from splitphase.engine.llm_engine import RequestOutput
from splitphase.engine.sampler import SampledToken
from splitphase.engine.sampling_params import SamplingParams
from splitphase.errors import UserError
from splitphase.server.errors import APIError, bad_request
from splitphase.server.protocol import Timings
from splitphase.server.state import RETRY_AFTER_S, ServerState


@dataclass
class SeqState:
    """One choice: which prompt it samples, what was sent of it, and its latest output."""

    index: int
    prompt_index: int
    sent_tokens: int = 0
    last: RequestOutput | None = None

    @property
    def finished(self) -> bool:
        """True once its final output arrived."""
        return self.last is not None and self.last.finished


@dataclass(frozen=True)
class Event:
    """New output of one sequence: the text delta and the tokens (with logprobs) since last."""

    seq: SeqState
    output: RequestOutput
    new_token_ids: list[int]
    new_logprobs: list[SampledToken] = field(default_factory=list)
    first: bool = False  # the first output of this sequence


class Generation:
    """Runs one request's prompts through the AsyncEngine and yields `Event`s."""

    def __init__(self, state: ServerState, request_id: str, prompts: list[list[int]],
                 params: SamplingParams, prompt_logprobs: int | None = None) -> None:
        self.state, self.request_id, self.prompts = state, request_id, prompts
        self.params, self.prompt_logprobs = params, prompt_logprobs
        n = params.n
        self.seqs = {(p, k): SeqState(p * n + k, p) for p in range(len(prompts)) for k in range(n)}
        self._outputs: AsyncGenerator[RequestOutput, None] | None = None
        self._admitted = False
        self._closed = False
        self._error: BaseException | None = None
        self._prefilled: set[int] = set()
        self._start_s = time.perf_counter()
        self.output_tokens = 0  # generated so far, over all sequences

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens over all prompts (each counted once, whatever n is)."""
        return sum(len(p) for p in self.prompts)

    def finish_reason(self) -> str:
        """Choice 0's finish reason, or why it has none (abort, error)."""
        last = self.seqs[(0, 0)].last
        if last is not None and last.finished:
            return last.finish_reason or "stop"
        return "error" if self._error is not None else "abort"

    @property
    def num_seqs(self) -> int:
        """Sequences this request occupies in the engine."""
        return len(self.seqs)

    def admit(self) -> None:
        """Take seats in the engine or raise the 429/503/400 that says why not."""
        self.state.admit(self.num_seqs)
        self._admitted = True
        self._start_s = time.perf_counter()

    async def events(self) -> AsyncIterator[Event]:
        """Yield outputs as the engine produces them, until every sequence finished."""
        if not self._admitted:
            self.admit()
        rids = [f"{self.request_id}-{p}" for p in range(len(self.prompts))]
        self._outputs = self.state.engine.generate_all(self.prompts, self.params, rids,
                                                       self.prompt_logprobs)
        try:
            async for out in self._outputs:
                yield self._event(out)
        except Exception as exc:
            self._error = exc
            raise map_engine_error(exc) from exc

    def _event(self, out: RequestOutput) -> Event:
        parent, _, k = out.request_id.partition("#")
        p = int(parent.rsplit("-", 1)[1])
        seq = self.seqs[(p, int(k) if k else 0)]
        first = seq.last is None
        if p not in self._prefilled:
            self._prefilled.add(p)
            self.state.metrics.prompt_tokens.inc(len(self.prompts[p]))
        new_ids = out.token_ids[seq.sent_tokens :]
        new_lps = out.logprobs[seq.sent_tokens :] if out.logprobs else []
        seq.sent_tokens, seq.last = len(out.token_ids), out
        self.output_tokens += len(new_ids)
        self.state.metrics.generation_tokens.inc(len(new_ids))
        if out.finished:
            self.state.metrics.observe_finished(
                out.finish_reason or "stop", out.request, time.perf_counter() - self._start_s
            )
        return Event(seq, out, new_ids, new_lps, first)

    async def close(self) -> None:
        """Abort what is unfinished, record it, give the seats back (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._outputs is not None:
            # Its cleanup aborts what is unfinished. RuntimeError: a cancelled consumer is
            # still inside it, and its cancellation runs the same cleanup.
            with contextlib.suppress(RuntimeError):
                await self._outputs.aclose()
        if not self._admitted:
            return
        reason = "error" if self._error is not None else "abort"
        e2e_s = time.perf_counter() - self._start_s
        for seq in self.seqs.values():
            if not seq.finished:
                request = seq.last.request if seq.last is not None else None
                self.state.metrics.observe_finished(reason, request, e2e_s)
        self.state.release(self.num_seqs)

    def finals(self) -> list[RequestOutput]:
        """The final output of every sequence, in choice order (after `events` ran out)."""
        outs = [s.last for s in sorted(self.seqs.values(), key=lambda s: s.index)]
        if any(o is None for o in outs):
            raise APIError(500, "the engine ended a request without its output")
        return [o for o in outs if o is not None]

    def timings(self) -> Timings:
        """Choice 0's phase times."""
        first = self.seqs[(0, 0)].last
        req = first.request if first is not None else None
        if req is None:
            return Timings()
        return Timings(queue_s=req.queue_s, prefill_s=req.prefill_s, ttft_s=req.ttft_s,
                       decode_s=req.decode_s, tpot_s=req.tpot_s)


def map_engine_error(exc: BaseException) -> APIError:
    """The answer for an exception from the engine."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"the engine is not running ({exc}); retry later",
                        code="engine_unavailable")
    died = exc if isinstance(exc, WorkerDiedError) else getattr(exc, "cause", None)
    if isinstance(died, WorkerDiedError):  # not this request's fault: the pair is restarted
        why = str(died).split("; call restart()")[0]  # the server restarts it, not the client
        return APIError(503, f"a worker of the disaggregated pair failed ({why}); the server "
                        f"restarts it: retry after {RETRY_AFTER_S} s", code="worker_unavailable",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, EngineStepError):
        return APIError(500, f"the model step serving this request failed: {exc}",
                        code="engine_step_failed")
    if isinstance(exc, UserError):
        return bad_request(str(exc))
    return APIError(500, f"the engine failed: {type(exc).__name__}", code="engine_error")
