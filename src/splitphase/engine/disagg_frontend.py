"""The front end's bookkeeping: one mirror `Request` per request, merged from worker records.

Records from the two workers arrive on two connections, so a decode record can overtake the
prefill record of the same request's first token; a record that starts past the tokens known
so far waits in a stash until the gap is filled. Outputs are merged per request per `step()`,
as LLMEngine emits at most one output per request per step. No torch, no sockets.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from splitphase.engine.disagg_protocol import OutputRecord, WorkerUpdate
from splitphase.engine.llm_engine import RequestOutput
from splitphase.engine.request import Request, RequestStatus
from splitphase.engine.sampler import SampledToken
from splitphase.engine.sampling_params import SamplingParams
from splitphase.errors import UserError

_STATUS = {s.finish_reason: s for s in RequestStatus if s.finish_reason is not None}


@dataclass
class Live:
    """A request the front end still owes outputs for."""

    request: Request  # the mirror: tokens and timestamps on the front end's clock
    owner: str = "prefill"  # the worker that holds it now
    text: str = ""
    delta: str = ""  # text not yet handed out
    logprobs: list[SampledToken] = field(default_factory=list)
    prompt_logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] | None = None
    stash: list[OutputRecord] = field(default_factory=list)


class FrontendState:
    """Live requests, outputs ready to hand out, and failures to report."""

    def __init__(self) -> None:
        self.live: dict[str, Live] = {}
        self._touched: dict[str, None] = {}  # ordered set: advanced since the last collect
        self._ended: list[RequestOutput] = []  # aborted since the last collect
        self._failed: list[str] = []
        self._fail_reason = ""

    def add(self, rid: str, ids: list[int], params: SamplingParams, arrival_s: float) -> None:
        """Track a new request and its n > 1 siblings (named id#k, as the scheduler does)."""
        rids = [rid] + [f"{rid}#{k}" for k in range(1, params.n)]
        if any(r in self.live for r in rids):
            raise UserError(f"request id {rid!r} is already in use")
        parent = Request(rid, ids, params, arrival_s)
        self.live[rid] = Live(parent)
        for k, r in enumerate(rids[1:], start=1):
            child = Request(r, ids, params, arrival_s, parent_id=rid, sample_index=k)
            parent.children.append(child)
            self.live[r] = Live(child)

    def abort(self, rid: str, status: RequestStatus) -> list[str]:
        """End a request and its siblings now; returns the ids the workers must drop."""
        live = self.live.get(rid)
        if live is None:
            return []
        ids = [rid] + [c.request_id for c in live.request.children if c.request_id in self.live]
        now = time.perf_counter()
        for r in ids:
            ended = self.live.pop(r)
            ended.request.finish(status, now)
            self._touched.pop(r, None)
            self._ended.append(_output(ended))
        return ids

    def fail(self, ids: list[str], reason: str) -> None:
        """End requests with an error, reported by the next step as a StepFailedError."""
        now = time.perf_counter()
        for rid in ids:
            live = self.live.pop(rid, None)
            if live is not None:
                live.request.finish(RequestStatus.FINISHED_ERROR, now)
                self._touched.pop(rid, None)
                self._failed.append(rid)
                self._fail_reason = reason

    def take_failed(self) -> tuple[list[str], str] | None:
        """The failures not reported yet, and why."""
        if not self._failed:
            return None
        failed, self._failed = self._failed, []
        return failed, self._fail_reason

    def has_news(self) -> bool:
        """True if the next collect() or take_failed() has something to hand out."""
        return bool(self._touched or self._ended or self._failed)

    def has_unfinished(self) -> bool:
        """True while any request is live or has news pending."""
        return bool(self.live) or self.has_news()

    def apply(self, role: str, update: WorkerUpdate) -> tuple[list[str], list[dict[str, Any]]]:
        """Merge a worker's update; returns (ids that worker must abort, requests to readmit)."""
        aborts = []
        for rid in update.adopted:
            if rid in self.live:
                self.live[rid].owner = "decode"
            else:  # aborted while its K/V was on the wire: the decode worker adopted it after
                aborts.append(rid)
        for rec in update.outputs:
            live = self.live.get(rec.request_id)
            if live is None:
                if not rec.finished and rec.request_id not in aborts:
                    aborts.append(rec.request_id)  # we let it go (aborted, failed) but it runs
            elif rec.finish_reason == "error":
                self.fail([rec.request_id], f"the {role} worker could not serve it")
            else:
                self._merge_in_order(live, rec)
        readmits = []
        for meta in update.preempted:
            live = self.live.get(meta["request"]["request_id"])
            if live is not None:
                live.owner = "prefill"
                readmits.append(meta)
        return aborts, readmits

    def _merge_in_order(self, live: Live, rec: OutputRecord) -> None:
        live.stash.append(rec)
        progressed = True
        while progressed:
            progressed = False
            for r in sorted(live.stash, key=lambda r: r.first_index):
                if r.first_index <= live.request.num_output_tokens:
                    live.stash.remove(r)
                    _merge(live, r)
                    progressed = True
        self._touched[live.request.request_id] = None

    def collect(self) -> list[RequestOutput]:
        """One output per request that advanced or ended since the last call."""
        outputs, self._ended = self._ended, []
        for rid in self._touched:
            live = self.live[rid]
            outputs.append(_output(live))
            if live.request.is_finished:
                del self.live[rid]
        self._touched.clear()
        return outputs


def _merge(live: Live, rec: OutputRecord) -> None:
    req = live.request
    arrival = req.arrival_time_s
    start, end = rec.first_index, rec.first_index + len(rec.new_token_ids)
    req.output_token_ids[start:end] = rec.new_token_ids
    req.token_times_s[start:end] = [arrival + off for off in rec.new_token_offsets_s]
    if req.first_token_s is None and req.token_times_s:
        req.first_token_s = req.token_times_s[0]
    if req.first_scheduled_s is None and rec.first_scheduled_offset_s is not None:
        req.first_scheduled_s = arrival + rec.first_scheduled_offset_s
    req.num_preemptions = max(req.num_preemptions, rec.num_preemptions)
    if rec.prefill_len:  # the front end never admits it: the workers' admissions count
        req.prefill_len, req.num_cached_tokens = rec.prefill_len, rec.num_cached_tokens
    if rec.new_logprobs:
        live.logprobs[end - len(rec.new_logprobs) : end] = rec.new_logprobs
    if rec.prompt_logprobs is not None:
        live.prompt_logprobs = rec.prompt_logprobs
    live.text += rec.delta
    live.delta += rec.delta
    if rec.finished and not req.is_finished:
        req.finish(_STATUS[rec.finish_reason or "error"], time.perf_counter())


def _output(live: Live) -> RequestOutput:
    req = live.request
    delta, live.delta = live.delta, ""
    return RequestOutput(
        req.request_id,
        req.prompt_token_ids,
        list(req.output_token_ids),
        live.text,
        delta,
        req.is_finished,
        req.finish_reason,
        list(live.logprobs),
        live.prompt_logprobs,
        req,
    )
