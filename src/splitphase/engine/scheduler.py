"""The engine's scheduler: which requests run each step, with how many tokens (no torch).

Loop contract (vLLM v1 vocabulary): `out = schedule(now_s)`; the runner executes `out`
(block copies and KV loads first, then one forward pass); `update_from_output(out, sampled,
now_s)` appends the sampled tokens, applies the stop rules (`stop.py`) and frees finished
requests' blocks.
One step is in flight at a time. Token positions: a `ScheduledChunk` feeds positions
[start, start + num_tokens) and attends over [0, start + num_tokens); row i of the
`DecodeBatch` feeds token_ids[i] at position positions[i] and attends over
[0, positions[i] + 1) (iterating it yields the same rows as `ScheduledDecode`s). The slot of
position p is block_table[p // block_size] * block_size + p % block_size
(`block_manager.slots_from_block_table`).

Disaggregation: a single Scheduler never runs both halves. `policy="disaggregated"` needs
`role="prefill"` (prompt chunks only; a request whose first token is sampled leaves through
`pop_handoffs()` and keeps its blocks here until `release_handoff()`, after the driver has
copied its KV) or `role="decode"` (takes such requests with `add_prefilled_request()`, lists the
KV to load in `SchedulerOutput.kv_loads`, and hands preempted requests back through
`pop_handoffs()` for a fresh prefill on the prefill worker).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Mapping, Sequence

from splitphase.engine import policies
from splitphase.engine.block_manager import BlockManager
from splitphase.engine.handoff import Handoff, HandoffBook
from splitphase.engine.policies import (
    DecodeBatch,
    ScheduledChunk,
    ScheduledDecode,
    ScheduledKVLoad,
    SchedulerOutput,
    StepPlan,
)
from splitphase.engine.request import Request, RequestStatus
from splitphase.engine.scheduler_config import (
    SchedulerConfig,
    SchedulerError,
)
from splitphase.engine.stop import StopChecker, check_stop

__all__ = [
    "DecodeBatch",
    "Handoff",
    "ScheduledChunk",
    "ScheduledDecode",
    "ScheduledKVLoad",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerError",
    "SchedulerOutput",
]

_PLANS = {
    ("mixed", None): policies.plan_mixed,
    ("chunked", None): policies.plan_chunked,
    ("disaggregated", "prefill"): policies.plan_prefill_worker,
    ("disaggregated", "decode"): policies.plan_decode_worker,
}


class Scheduler:
    """Owns the waiting and running queues and one BlockManager; see the module docstring."""

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.block_manager = BlockManager(
            config.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.max_num_seqs = config.max_num_seqs
        self.max_model_len: int = config.max_model_len or 0
        # Read them, do not mutate them: policies.py is their only other writer.
        self.running: list[Request] = []  # oldest first
        self.waiting: deque[Request] = deque()
        self._requests: dict[str, Request] = {}  # waiting, running, or ready to hand off
        self._age: dict[str, tuple[float, int]] = {}  # (arrival, admission order)
        self._next_order = 0
        self._handoffs = HandoffBook(self.block_manager)
        self._pending_copies: list[tuple[Request, int, int]] = []
        self._step_id = 0
        self._in_flight: tuple[int, dict[str, Request], list[Request]] | None = None
        self._plan = _PLANS[(config.policy, config.role)]

    # ---- queries ------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        """Requests queued for (re)admission."""
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        """Requests holding KV blocks and being stepped."""
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting, running or ready to hand off."""
        return bool(self._requests)

    def get_request(self, request_id: str) -> Request | None:
        """The live request with this id, if this scheduler owns it."""
        return self._requests.get(request_id)

    # ---- intake -------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a new request, or a preempted one handed back for recompute (queued first)."""
        if self.config.role == "decode":
            raise SchedulerError(
                "a decode-role scheduler only takes prefilled requests: use add_prefilled_request()"
            )
        if request.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            raise SchedulerError(f"request {request.request_id!r} is {request.status.value}")
        self._register(request)
        request.num_computed_tokens = 0
        request.prefill_len = request.num_tokens
        if request.status is RequestStatus.PREEMPTED:
            self.waiting.appendleft(request)  # vLLM: preempted requests go first
        else:
            self.waiting.append(request)

    def add_prefilled_request(self, request: Request) -> None:
        """Decode role: queue a request whose prompt KV was computed by a prefill worker."""
        if self.config.role != "decode":
            raise SchedulerError("add_prefilled_request() needs role='decode'; use add_request()")
        if request.num_output_tokens < 1 or request.num_computed_tokens != request.num_tokens - 1:
            raise SchedulerError(
                f"request {request.request_id!r} is not prefilled: it needs its first token"
                f" sampled and num_computed_tokens == num_tokens - 1, got"
                f" {request.num_computed_tokens} of {request.num_tokens}"
            )
        if request.is_finished:
            raise SchedulerError(f"request {request.request_id!r} is already finished")
        self._register(request)
        request.block_table = []  # the prefill worker's table means nothing here
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def _register(self, request: Request) -> None:
        rid = request.request_id
        if rid in self._requests or self._handoffs.is_held(rid):
            raise SchedulerError(f"request id {rid!r} is already in use")
        if request.num_tokens > self.max_model_len:
            raise SchedulerError(
                f"request {rid!r} has {request.num_tokens} tokens, more than max_model_len="
                f"{self.max_model_len}; shorten the prompt or raise max_model_len"
            )
        self._requests[rid] = request
        self._age[rid] = (request.arrival_time_s, self._next_order)
        self._next_order += 1

    # ---- the step -----------------------------------------------------------------------
    def schedule(self, now_s: float) -> SchedulerOutput:
        """Choose this step's work under the policy and the batch limits."""
        if self._in_flight is not None:
            raise SchedulerError(
                f"step {self._in_flight[0]} is in flight: call update_from_output() first"
            )
        cfg = self.config
        plan = StepPlan(cfg.max_num_batched_tokens, cfg.long_prefill_token_threshold)
        self._plan(self, plan)
        copies: tuple[tuple[int, int], ...] = ()
        if self._pending_copies:  # only after an n > 1 fork
            copies = tuple(
                (src, dst)
                for child, src, dst in self._pending_copies
                if child.status is RequestStatus.RUNNING and dst in child.block_table
            )
            self._pending_copies.clear()
        out = policies.build_output(plan, self._step_id, self.block_manager, now_s, copies)
        if out.num_seqs:
            # Decoding requests in the order of out.decode's rows: no per-row lookup by id.
            chunks = {r.request_id: r for r, _ in plan.chunks}
            self._in_flight = (self._step_id, chunks, plan.decodes)
        self._step_id += 1
        return out

    @property
    def has_pending_block_copies(self) -> bool:
        """True after an n > 1 fork, until the next `schedule()` hands its block copies out."""
        return bool(self._pending_copies)

    def skip_steps(self, num_steps: int) -> int:
        """Count steps applied without `schedule()` (`decode_run`); return the first one's id."""
        if self._in_flight is not None:
            raise SchedulerError(f"step {self._in_flight[0]} is in flight: finish it first")
        first, self._step_id = self._step_id, self._step_id + num_steps
        return first

    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled_token_ids: Mapping[str, Sequence[int]],
        now_s: float,
        stop_checker: StopChecker | None = None,
    ) -> list[Request]:
        """Apply one step's sampled tokens; return the requests that finished in it.

        `sampled_token_ids[id]` holds `num_samples` tokens for a last chunk and one per decode;
        non-final chunks sample nothing. Requests aborted since `schedule` are skipped.
        """
        if self._in_flight is None and not output.num_seqs:
            return []
        if self._in_flight is None or output.step_id != self._in_flight[0]:
            expected = None if self._in_flight is None else self._in_flight[0]
            raise SchedulerError(
                f"output of step {output.step_id}, but step {expected} is in flight"
            )
        _, chunk_reqs, decode_reqs = self._in_flight
        self._in_flight = None
        finished: list[Request] = []
        for chunk in output.prefill:
            req = chunk_reqs[chunk.request_id]
            if req.status is not RequestStatus.RUNNING:
                continue
            req.num_computed_tokens += chunk.num_tokens
            self.block_manager.cache_computed_blocks(req)
            if not chunk.is_last_chunk:
                continue
            tokens = self._sampled(sampled_token_ids, chunk.request_id, chunk.num_samples)
            # Children first: they fork the parent's blocks before a stop could free them.
            self._spawn_children(req, tokens[1:], now_s, stop_checker, finished)
            self._on_token(req, tokens[0], now_s, stop_checker, finished)
            if self.config.role == "prefill" and req.status is RequestStatus.RUNNING:
                self.running.remove(req)
                self._handoffs.ready.append(req)
        self._apply_decodes(
            output.decode.request_ids, decode_reqs, sampled_token_ids, now_s, stop_checker, finished
        )
        return finished

    def _apply_decodes(
        self,
        request_ids: Sequence[str],
        requests: Sequence[Request],
        sampled_token_ids: Mapping[str, Sequence[int]],
        now_s: float,
        stop_checker: StopChecker | None,
        finished: list[Request],
    ) -> None:
        # The per-token loop of every step: _sampled's and _on_token's work is inlined.
        bm, running = self.block_manager, RequestStatus.RUNNING
        caching = bm.enable_prefix_caching
        get = sampled_token_ids.get
        eos, max_len = self.config.eos_token_id, self.max_model_len
        for rid, req in zip(request_ids, requests, strict=True):
            if req.status is not running:
                continue
            req.num_computed_tokens += 1
            if caching:
                bm.cache_computed_blocks(req)
            tokens = get(rid)
            if tokens is None or len(tokens) != 1:
                self._sampled(sampled_token_ids, rid, 1)  # raises, naming what is missing
                continue
            req.append_output_token(tokens[0], now_s)
            status = check_stop(req, eos, max_len, stop_checker)
            if status is not None:
                self._finish(req, status, now_s)
                finished.append(req)

    def _sampled(self, sampled: Mapping[str, Sequence[int]], rid: str, n: int) -> Sequence[int]:
        tokens = sampled.get(rid)
        if tokens is None or len(tokens) != n:
            got = "none" if tokens is None else f"{len(tokens)}"
            raise SchedulerError(f"request {rid!r} needs {n} sampled token(s) this step, got {got}")
        return tokens

    def _on_token(
        self,
        req: Request,
        token_id: int,
        now_s: float,
        stop_checker: StopChecker | None,
        finished: list[Request],
    ) -> None:
        req.append_output_token(token_id, now_s)
        status = check_stop(req, self.config.eos_token_id, self.max_model_len, stop_checker)
        if status is not None:
            self._finish(req, status, now_s)
            finished.append(req)

    def _spawn_children(
        self,
        parent: Request,
        tokens: Sequence[int],
        now_s: float,
        stop_checker: StopChecker | None,
        finished: list[Request],
    ) -> None:
        """n > 1: fork samples 1..n-1 off the parent's computed prompt (shared full blocks)."""
        for i, token_id in enumerate(tokens, start=1):
            child = Request(
                f"{parent.request_id}#{i}",
                parent.prompt_token_ids,
                parent.sampling_params,
                parent.arrival_time_s,
                parent.eos_token_id,
                parent.request_id,
                i,
            )
            self._register(child)
            child.num_computed_tokens = child.prefill_len = parent.num_computed_tokens
            child.num_cached_tokens = parent.num_cached_tokens
            child.first_scheduled_s = parent.first_scheduled_s
            child.status = RequestStatus.RUNNING
            parent.children.append(child)
            self._on_token(child, token_id, now_s, stop_checker, finished)
            if child.is_finished:
                continue
            bm = self.block_manager
            if self.config.role == "prefill":
                bm.fork(parent, child, copy_partial=False)  # read-only from here: share all
                self._handoffs.ready.append(child)
            elif len(self.running) < self.max_num_seqs and bm.can_fork(parent):
                self._pending_copies += [(child, s, d) for s, d in bm.fork(parent, child)]
                self.start_running(child)
            else:  # no seat or block now: recompute later (the prefix cache makes it cheap)
                child.num_computed_tokens, child.prefill_len = 0, child.num_tokens
                child.status = RequestStatus.WAITING
                self.waiting.appendleft(child)

    # ---- state changes used by policies ---------------------------------------------------
    def start_running(self, request: Request) -> None:
        """Move an admitted request into `running`, keeping age order."""
        request.status = RequestStatus.RUNNING
        bisect.insort(self.running, request, key=lambda r: self._age[r.request_id])

    def preempt(self, request: Request, plan: StepPlan) -> None:
        """Preempt by recompute: free its blocks, keep its tokens, prefill them all again later."""
        self.running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.prefill_len = request.num_tokens
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        plan.preempted.append(request)
        if self.config.role == "decode":
            self._handoffs.ready.append(request)  # no prefill here: back to the prefill worker
        else:
            self.waiting.appendleft(request)

    # ---- leaving ------------------------------------------------------------------------
    def abort_request(
        self,
        request_id: str,
        now_s: float | None = None,
        status: RequestStatus = RequestStatus.FINISHED_ABORTED,
    ) -> Request | None:
        """Finish a request in any state (ABORTED or ERROR) and free its blocks at once.

        Returns it, or None if unknown here; for a prefill worker's popped handoff it only
        releases the blocks (the request itself now belongs to the decode side).
        """
        if status not in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR):
            raise SchedulerError(
                f"abort status must be FINISHED_ABORTED or FINISHED_ERROR, got {status}"
            )
        req = self._requests.get(request_id)
        if req is None:
            if self._handoffs.is_held(request_id):
                self.release_handoff(request_id)
            return None
        self._finish(req, status, now_s)
        return req

    def _finish(self, req: Request, status: RequestStatus, now_s: float | None) -> None:
        rid = req.request_id
        for queue in (self.running, self.waiting, self._handoffs.ready):
            if req in queue:
                queue.remove(req)
        if self.block_manager.has_blocks(rid):
            self.block_manager.free(req)
        self._forget(rid)
        req.finish(status, now_s)

    def pop_handoffs(self) -> list[Handoff]:
        """Requests now belonging to the other worker (see `Handoff`); they leave this scheduler."""
        return self._handoffs.pop(self._forget)

    def _forget(self, request_id: str) -> None:
        del self._requests[request_id]
        del self._age[request_id]

    def release_handoff(self, request_id: str) -> None:
        """Prefill role: free a popped handoff's blocks once its KV has been copied out."""
        self._handoffs.release(request_id)
