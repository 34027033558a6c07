"""Runs of decode-only steps whose schedule is provably known, applied at once (no torch).

A simulator spends most of its steps decoding: every running request feeds one token, and
nothing that could change the next `schedule()` happens. `decode_run_length` proves, from the
scheduler's state between steps, for how many steps `schedule()` would return exactly that (the
running list as decode rows, in order; no chunk, admission, preemption or finish), and
`advance_decode_run` applies such steps in one pass, making the BlockManager calls that
step-by-step scheduling makes, in the same order, so block tables, prefix hashes, token lists,
times and step ids come out as they would have.

Why, policy by policy (`policies.plan_*`):
- `schedule_decodes`: every running request is past its prefill (checked), so each is a decode
  row, oldest first, while nobody is added, finishes or is preempted. A row needs a block only
  when its context crosses a block boundary; nothing is freed within a run, so the run stops
  before the allocation that would exceed the free blocks (the step that would preempt).
- `schedule_prefill_chunks`: no running request is prefilling.
- `admit_waiting` / `admit_prefilled`: the queue is empty, or its head is blocked by something
  that stays true while free blocks only shrink: no seat, no token budget, or (without prefix
  caching, where admission needs only free blocks) no room for its blocks. A request added
  while a run is in flight is the caller's to handle: it must stop the run first.
- Stop rules: every row samples `token_id` (a simulator's fixed token): the run ends before the
  first step in which a row reaches max_tokens or max_model_len, and `token_id` is not a stop
  token or an honoured EOS of any row. The caller's `update_from_output` takes no stop_checker.
- A pending block copy (after an n > 1 fork) goes out with the next step: no run then.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat

from splitphase.engine.request import Request, RequestStatus
from splitphase.engine.scheduler import Scheduler


def decode_run_length(sched: Scheduler, token_id: int, max_steps: int) -> int:
    """Steps from now that `schedule()` would make decode every running request, alone (0: none).

    Call it between steps (nothing in flight).
    """
    running = sched.running
    if not running or sched.has_pending_block_copies or max_steps < 1:
        return 0
    youngest = running[-1]  # the one most often still in its prompt: ask it before the loop
    if youngest.num_computed_tokens < youngest.prefill_len:
        return 0
    if sched.waiting and not _admission_stays_blocked(sched, len(running)):
        return 0
    eos, status = sched.config.eos_token_id, RequestStatus.RUNNING
    # A row finishes in step s when its outputs + s reach max_tokens or its tokens + s reach
    # max_model_len: the run stops before the first such step. (Inlined: once per row per run.)
    steps, tokens_left = max_steps, sched.max_model_len - 1
    for r in running:
        sp, outputs = r.sampling_params, len(r.output_token_ids)
        if r.status is not status or r.num_computed_tokens < r.prefill_len:
            return 0  # still in its prompt: a chunk, not a decode
        if sp.stop_token_ids and token_id in sp.stop_token_ids or (
                not sp.ignore_eos and token_id == (r.eos_token_id if r.eos_token_id is not None
                                                   else eos)):
            return 0
        left = sp.max_tokens - outputs - 1
        if left < steps:
            steps = left
        left = tokens_left - len(r.prompt_token_ids) - outputs
        if left < steps:
            steps = left
    if steps < 1:
        return 0
    bm = sched.block_manager
    free, bs = bm.num_free_blocks, bm.block_size
    if _num_block_events(running, bs, steps) > free:
        crossings = sorted(s for s, _ in _block_events(running, bs, steps))
        steps = crossings[free] - 1  # that step's allocation would find no block: it preempts
    return steps


def _admission_stays_blocked(sched: Scheduler, num_rows: int) -> bool:
    """True if the queue's head cannot be admitted now and no step of a run can change that."""
    cfg, bm = sched.config, sched.block_manager
    if len(sched.running) >= sched.max_num_seqs or cfg.max_num_batched_tokens - num_rows <= 0:
        return True
    # With prefix caching a run's newly hashed (or evicted) blocks change the head's hits.
    return not bm.enable_prefix_caching and not bm.can_allocate(sched.waiting[0])


def _first_block_step(r: Request, block_size: int) -> int:
    """The step (1 = the next) whose fed position, num_computed + s - 1, needs a new block."""
    return len(r.block_table) * block_size - r.num_computed_tokens + 1


def _num_block_events(rows: Sequence[Request], block_size: int, last: int) -> int:
    """Block allocations in steps 1..last: one at each row's first crossing, then every block."""
    n = 0
    for r in rows:
        s = _first_block_step(r, block_size)
        if s <= last:
            n += (last - s) // block_size + 1
    return n


def _block_events(rows: Sequence[Request], block_size: int, last: int) -> list[tuple[int, int]]:
    """(step, row) of each block allocation in steps 1..last."""
    events: list[tuple[int, int]] = []
    for i, r in enumerate(rows):
        s = len(r.block_table) * block_size - r.num_computed_tokens + 1  # _first_block_step
        while s <= last:  # most runs are shorter than a block: at most one crossing a row
            events.append((s, i))
            s += block_size
    return events


def advance_decode_run(sched: Scheduler, rows: Sequence[Request], num_steps: int,
                       token_id: int, end_times_s: Sequence[float]) -> int:
    """Apply `num_steps` steps of a run proved by `decode_run_length`; the first one's step id.

    `rows` are the running requests when the run was proved; step k (1-based) ends at
    end_times_s[k - 1]. Nothing may be in flight.
    """
    bm = sched.block_manager
    bs, caching = bm.block_size, bm.enable_prefix_caching
    times = end_times_s[:num_steps]
    start = [r.num_computed_tokens for r in rows]
    for r in rows:  # the tokens first: hashing a block reads them
        r.output_token_ids.extend(repeat(token_id, num_steps))
        r.token_times_s.extend(times)
    # Step k's schedule allocates (order 0), then its update hashes full blocks (order 1): the
    # order step-by-step scheduling makes these calls in, which fixes block ids and evictions.
    events = [(s, 0, i) for s, i in _block_events(rows, bs, num_steps)]
    if caching:
        for i, c in enumerate(start):
            first_full = bs - c % bs  # the step after which position c + k - 1 ends a block
            events.extend((s, 1, i) for s in range(first_full, num_steps + 1, bs))
    events.sort()
    for s, kind, i in events:
        r = rows[i]
        if kind == 0:
            r.num_computed_tokens = start[i] + s - 1
            if not bm.try_append_slots(r, 1):
                raise AssertionError(f"decode run: no block for {r.request_id!r} in step {s}")
        else:
            r.num_computed_tokens = start[i] + s
            bm.cache_computed_blocks(r)
    for r, c in zip(rows, start, strict=True):
        r.num_computed_tokens = c + num_steps
    return sched.skip_steps(num_steps)
