"""What runs in one step: the `SchedulerOutput` contract and the per-policy decisions (no torch).

`Scheduler.schedule()` fills a `StepPlan` with one of the `plan_*` functions below and turns it
into a `SchedulerOutput` with `build_output`. The building blocks of the plans:

- `schedule_decodes`: every running request past its prefill gets one token, oldest first;
  when a block is missing, the youngest running request is preempted by recompute (vLLM).
- `schedule_prefill_chunks`: requests admitted earlier continue their prompt in chunks.
- `admit_waiting`: FCFS admission of waiting requests (whole prompts or chunks).
- `admit_prefilled`: the decode worker's admission of requests whose KV was computed elsewhere.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Protocol

from splitphase.engine.block_manager import BlockManager
from splitphase.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledChunk:
    """Prompt tokens [start, start + num_tokens) of one request; the last chunk samples."""

    request_id: str
    start: int  # num_computed_tokens before this step
    num_tokens: int
    is_last_chunk: bool  # the chunk ends the (re)prefill: sample from its last position
    num_samples: int  # tokens to sample from the last position: 0, 1, or n (fork for n > 1)
    token_ids: tuple[int, ...]  # the num_tokens input ids
    block_table: tuple[int, ...]  # covers every position of the request

    @property
    def end(self) -> int:
        """One past the last position fed (also the attention context length)."""
        return self.start + self.num_tokens


@dataclass(frozen=True)
class ScheduledDecode:
    """One decode token: feed `token_id` at position context_len - 1, attend over context_len."""

    request_id: str
    context_len: int  # tokens in the context, including the one fed now
    token_id: int
    block_table: tuple[int, ...]

    @property
    def position(self) -> int:
        """Position of the fed token."""
        return self.context_len - 1


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """A step's decodes as columns: row i feeds token_ids[i] at positions[i] of request_ids[i].

    Row i attends over [0, positions[i] + 1) under block_tables[i]. Columns rather than one
    `ScheduledDecode` per request: a step decodes every running request, so per-row objects
    were a fifth of the scheduler's time, and the runner and the cost model read whole columns
    anyway. Iterating (or indexing) still yields `ScheduledDecode` rows.
    """

    request_ids: tuple[str, ...]
    positions: tuple[int, ...]  # num_computed_tokens: the cached tokens each row attends over
    token_ids: tuple[int, ...]
    block_tables: tuple[tuple[int, ...], ...]

    def __len__(self) -> int:
        return len(self.request_ids)

    def __iter__(self) -> Iterator[ScheduledDecode]:
        for rid, pos, tok, table in zip(
            self.request_ids, self.positions, self.token_ids, self.block_tables, strict=True
        ):
            yield ScheduledDecode(rid, pos + 1, tok, table)

    def __getitem__(self, i: int) -> ScheduledDecode:
        return ScheduledDecode(
            self.request_ids[i], self.positions[i] + 1, self.token_ids[i], self.block_tables[i]
        )

    @property
    def num_cached_tokens(self) -> int:
        """KV positions read by the batch's attention, besides the fed tokens themselves."""
        return sum(self.positions)


EMPTY_DECODES = DecodeBatch((), (), (), ())


@dataclass(frozen=True)
class ScheduledKVLoad:
    """Decode worker: KV of positions [start, start + num_tokens) arrives into `block_table`."""

    request_id: str
    start: int  # first position not already in this worker's prefix cache
    num_tokens: int
    block_table: tuple[int, ...]


@dataclass(frozen=True)
class SchedulerOutput:
    """Everything the runner needs for one step, tagged with its phase."""

    step_id: int
    prefill: tuple[ScheduledChunk, ...]
    decode: DecodeBatch
    preempted_request_ids: tuple[str, ...]
    block_copies: tuple[tuple[int, int], ...]  # (src, dst) block ids: copy before the forward
    kv_loads: tuple[ScheduledKVLoad, ...]  # decode role only: load before the forward
    block_size: int
    prefix_cache_queries_tokens: int = 0  # admissions' prompt tokens looked up this step
    prefix_cache_hits_tokens: int = 0  # of those, found (vLLM's prefix_cache_queries / _hits)

    @property
    def num_prefill_tokens(self) -> int:
        """Prompt tokens fed this step."""
        return sum(c.num_tokens for c in self.prefill)

    @property
    def num_decode_seqs(self) -> int:
        """Sequences decoding one token this step."""
        return len(self.decode)

    @property
    def num_seqs(self) -> int:
        """Sequences in the batch."""
        return len(self.prefill) + len(self.decode)

    @property
    def num_batched_tokens(self) -> int:
        """Tokens fed through the model this step."""
        return self.num_prefill_tokens + self.num_decode_seqs

    @property
    def phase(self) -> str:
        """'prefill', 'decode', 'mixed' or 'idle'."""
        if self.prefill and self.decode:
            return "mixed"
        return "prefill" if self.prefill else "decode" if self.decode else "idle"


class PolicyHost(Protocol):
    """The scheduler state a policy reads and mutates."""

    block_manager: BlockManager
    max_num_seqs: int
    running: list[Request]  # oldest first (arrival time, then admission order)
    waiting: deque[Request]

    def preempt(self, request: Request, plan: StepPlan) -> None:
        """Free the request's blocks and send it back for recompute."""

    def start_running(self, request: Request) -> None:
        """Move an admitted request into `running`, keeping age order."""


@dataclass
class StepPlan:
    """A step being built: the token budget left and what has been scheduled so far."""

    token_budget: int
    chunk_cap: int | None = None  # long_prefill_token_threshold: max prompt tokens per request
    chunks: list[tuple[Request, int]] = field(default_factory=list)  # (request, num_new_tokens)
    decodes: list[Request] = field(default_factory=list)
    kv_loads: list[tuple[Request, int]] = field(default_factory=list)  # (request, first uncached)
    preempted: list[Request] = field(default_factory=list)
    prefix_cache_queries_tokens: int = 0
    prefix_cache_hits_tokens: int = 0

    def add_chunk(self, request: Request, num_tokens: int) -> None:
        """Schedule `num_tokens` prompt tokens of `request` from its num_computed_tokens."""
        self.chunks.append((request, num_tokens))
        self.token_budget -= num_tokens

    def add_decode(self, request: Request) -> None:
        """Schedule one decode token of `request`."""
        self.decodes.append(request)
        self.token_budget -= 1

    def is_scheduled(self, request: Request) -> bool:
        """True if the request already has work in this plan."""
        # Identity scans (a Request compares by identity) instead of a set of ids, which cost
        # an insert per decode per step; this is asked only of prefilling requests and of
        # preemption candidates, both rare.
        return request in self.decodes or any(r is request for r, _ in self.chunks)

    def chunk_size(self, request: Request) -> int:
        """Prompt tokens this request may take now: remaining, budget and chunk cap."""
        n = min(request.prefill_len - request.num_computed_tokens, self.token_budget)
        return n if self.chunk_cap is None else min(n, self.chunk_cap)


def schedule_decodes(host: PolicyHost, plan: StepPlan) -> None:
    """One token per running request past its prefill; preempt the youngest when out of blocks."""
    bm, running = host.block_manager, RequestStatus.RUNNING
    bs, decodes = bm.block_size, plan.decodes
    # Without prefix caching a decode whose last block has a free slot changes nothing in the
    # block manager (try_append_slots would return True at once), and request.block_table
    # mirrors the manager's table: that common case skips the call.
    fast = not bm.enable_prefix_caching
    first, budget = len(decodes), plan.token_budget
    for request in list(host.running):
        # Once per running request per step: is_prefilling's comparison is inlined.
        computed = request.num_computed_tokens
        if request.status is not running or computed < request.prefill_len:
            continue  # preempted earlier in this loop, or still in its prompt
        if len(decodes) - first >= budget:
            break  # cannot happen while max_num_batched_tokens >= max_num_seqs (validated)
        if fast and computed < len(request.block_table) * bs:
            decodes.append(request)
            continue
        while not bm.try_append_slots(request, 1):
            victim = _youngest_unscheduled(host, plan)
            host.preempt(victim, plan)
            if victim is request:
                break
        else:
            decodes.append(request)
    plan.token_budget = budget - (len(decodes) - first)


def _youngest_unscheduled(host: PolicyHost, plan: StepPlan) -> Request:
    # Recompute-preemption of the latest arrival, as vLLM does: the oldest request always makes
    # progress, so the system cannot livelock.
    for request in reversed(host.running):
        if not plan.is_scheduled(request):
            return request
    raise AssertionError("no preemptible request; the caller itself is unscheduled")


def schedule_prefill_chunks(host: PolicyHost, plan: StepPlan) -> None:
    """Continue prompts admitted in earlier steps, oldest first, within the budget."""
    for request in host.running:  # is_prefilling inlined: this visits every running request
        if (
            request.num_computed_tokens < request.prefill_len
            and not plan.is_scheduled(request)
        ):
            n = plan.chunk_size(request)
            if n <= 0:
                break
            plan.add_chunk(request, n)


def admit_waiting(host: PolicyHost, plan: StepPlan, whole_prompts: bool) -> None:
    """Admit waiting requests FCFS while blocks, seats and budget last.

    Blocks for the whole prompt are allocated at admission, so a chunked prompt never stalls
    half-way for memory. Nothing is admitted in a step that preempted (vLLM v1), which keeps a
    just-freed request from bouncing straight back in.
    """
    bm = host.block_manager
    while host.waiting and not plan.preempted and len(host.running) < host.max_num_seqs:
        request = host.waiting[0]
        if plan.token_budget <= 0 or not bm.can_allocate(request):
            break  # FCFS: the head of the queue is not overtaken
        if whole_prompts:
            uncached = request.prefill_len - bm.num_cached_prefix_tokens(request)
            if uncached > plan.token_budget:
                break
        cached = bm.allocate(request)
        host.waiting.popleft()
        request.num_computed_tokens = cached
        request.num_cached_tokens = cached
        if bm.enable_prefix_caching and request.use_prefix_cache:
            plan.prefix_cache_queries_tokens += request.prefill_len
            plan.prefix_cache_hits_tokens += cached
        host.start_running(request)
        n = request.prefill_len - cached if whole_prompts else plan.chunk_size(request)
        plan.add_chunk(request, n)


def admit_prefilled(host: PolicyHost, plan: StepPlan) -> None:
    """Decode worker: admit requests whose prompt KV arrives by transfer, and decode them now.

    The blocks cover every token (the computed ones plus the slot of the last sampled token);
    KV for positions [cached, num_computed_tokens) must be loaded before this step's forward.
    """
    bm = host.block_manager
    while host.waiting and not plan.preempted and len(host.running) < host.max_num_seqs:
        request = host.waiting[0]
        if plan.token_budget < 1 or not bm.can_allocate(request):
            break
        cached = bm.allocate(request)
        host.waiting.popleft()
        request.num_cached_tokens = cached
        host.start_running(request)
        if cached < request.num_computed_tokens:
            plan.kv_loads.append((request, cached))
        plan.add_decode(request)


def plan_mixed(host: PolicyHost, plan: StepPlan) -> None:
    """Continuous batching without chunking: running decodes plus whole waiting prompts.

    Decodes take their one token of budget first, so no running stream skips a step; whole
    prompts fill the rest in one chunk each. Unlike vLLM v0 (prefill-only steps that pause
    decodes), prompts and decodes share the step, so a long prompt stretches the step every
    stream waits on: the stall this policy exists to show.
    """
    schedule_decodes(host, plan)
    admit_waiting(host, plan, whole_prompts=True)


def plan_chunked(host: PolicyHost, plan: StepPlan) -> None:
    """Sarathi-Serve: decodes first, then prompt chunks (ongoing, then new) fill the budget."""
    schedule_decodes(host, plan)
    schedule_prefill_chunks(host, plan)
    admit_waiting(host, plan, whole_prompts=False)


def plan_prefill_worker(host: PolicyHost, plan: StepPlan) -> None:
    """Disaggregated prefill worker: prompt chunks only; finished prompts leave by handoff."""
    schedule_prefill_chunks(host, plan)
    admit_waiting(host, plan, whole_prompts=False)


def plan_decode_worker(host: PolicyHost, plan: StepPlan) -> None:
    """Disaggregated decode worker: running decodes first, then transferred-in requests."""
    schedule_decodes(host, plan)
    admit_prefilled(host, plan)


def build_output(
    plan: StepPlan,
    step_id: int,
    bm: BlockManager,
    now_s: float,
    block_copies: tuple[tuple[int, int], ...],
) -> SchedulerOutput:
    """Freeze a plan into the runner's contract, snapshotting tokens and block tables."""
    # bm.block_table(id) equals tuple(request.block_table) (the manager keeps the request's copy
    # in step) and is cached until the table changes: no per-step copy of every table.
    table = bm.block_table
    chunks = []
    for req, n in plan.chunks:
        req.record_scheduled(now_s)
        start = req.num_computed_tokens
        last = start + n == req.prefill_len
        samples = (req.sampling_params.n if will_fork(req) else 1) if last else 0
        chunks.append(
            ScheduledChunk(
                req.request_id,
                start,
                n,
                last,
                samples,
                tuple(req.get_token_ids(start, start + n)),
                table(req.request_id),
            )
        )
    loads = tuple(
        [
            ScheduledKVLoad(r.request_id, s, r.num_computed_tokens - s, table(r.request_id))
            for r, s in plan.kv_loads
        ]
    )
    preempted = tuple([r.request_id for r in plan.preempted])
    return SchedulerOutput(
        step_id,
        tuple(chunks),
        decode_batch(plan.decodes, bm),
        preempted,
        block_copies,
        loads,
        bm.block_size,
        plan.prefix_cache_queries_tokens,
        plan.prefix_cache_hits_tokens,
    )


_request_id = attrgetter("request_id")
_num_computed_tokens = attrgetter("num_computed_tokens")


def decode_batch(requests: list[Request], bm: BlockManager) -> DecodeBatch:
    """Snapshot decoding requests (num_computed_tokens == num_tokens - 1) as a `DecodeBatch`."""
    if not requests:
        return EMPTY_DECODES
    ids = tuple(map(_request_id, requests))
    # A decoding request has sampled at least one token (its prompt's last chunk sampled it, or
    # a prefill worker did), so the token it feeds is its last output.
    return DecodeBatch(
        ids,
        tuple(map(_num_computed_tokens, requests)),
        tuple([r.output_token_ids[-1] for r in requests]),
        bm.block_tables(ids),
    )


def will_fork(request: Request) -> bool:
    """True if the request's last prompt chunk samples all n of its sequences (n > 1)."""
    # Only sample 0, on its first prefill: after a preemption it already has outputs.
    sp = request.sampling_params
    return sp.n > 1 and request.parent_id is None and request.num_output_tokens == 0
