"""Runs of decode-only steps whose schedule is provably the same, applied at once (no torch).

A simulator spends most of its steps decoding: every running request feeds one token, and
nothing that could change the next `schedule()` happens. Once the real scheduler has produced
such a step, `decode_run_length` proves how many consecutive steps (that one first) would be the
same step again (the same rows in the same order, no chunk, no admission, no preemption, no
finish), and `advance_decode_run` applies the steps after the first in one pass, through the
same BlockManager calls in the same order as step-by-step scheduling would make them, so block
tables, prefix hashes, token lists, times and step ids come out as they would have.

Why such a step repeats, policy by policy (`policies.plan_*`):
- `schedule_decodes`: every running request is a decode row (checked), and the rows stay the
  running list in age order while nobody is added, finishes or is preempted. A row needs a new
  block only when its context crosses a block boundary; no block is freed within a run, so the
  run stops before the allocation that would exceed the free blocks (the step that preempts).
- `schedule_prefill_chunks`: no running request is prefilling (they all decode).
- `admit_waiting` / `admit_prefilled`: the queue is empty, or its head is blocked by something
  that stays true while free blocks only shrink: no seat, no token budget, or (without prefix
  caching, where admission needs only free blocks) no room for its blocks. A request added
  while a run is in flight is the caller's to handle: it must stop the run first.
- Stop rules: every row samples `token_id` (a simulator's fixed token): the run ends before the
  first step in which a row reaches max_tokens or max_model_len, and `token_id` is not a stop
  token or an honoured EOS of any row. The caller's `update_from_output` takes no stop_checker.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat

from splitphase.engine.policies import SchedulerOutput
from splitphase.engine.request import Request
from splitphase.engine.scheduler import Scheduler


def decode_run_length(sched: Scheduler, out: SchedulerOutput, token_id: int, max_steps: int
                      ) -> int:
    """Steps, `out` first, provably scheduled as `out` again (0 or 1: no run to skip).

    Call it right after `out = sched.schedule(now_s)`, before `update_from_output`.
    """
    running = sched.running
    if (out.prefill or out.preempted_request_ids or out.kv_loads or out.block_copies
            or len(out.decode) != len(running) or max_steps < 2):
        return 0
    ids = out.decode.request_ids
    if any(r.request_id != rid for r, rid in zip(running, ids, strict=True)):
        return 0  # a row admitted this step sits elsewhere in the age-ordered running list
    bm = sched.block_manager
    if sched.waiting and not _admission_stays_blocked(sched, len(ids)):
        return 0
    max_len, eos = sched.max_model_len, sched.config.eos_token_id
    steps = max_steps
    for r in running:
        sp = r.sampling_params
        if token_id in sp.stop_token_ids or (
                not sp.ignore_eos and token_id == (r.eos_token_id if r.eos_token_id is not None
                                                   else eos)):
            return 0
        # The row finishes in step s of the run when outputs + s reach a limit: stop before it.
        steps = min(steps, sp.max_tokens - len(r.output_token_ids) - 1,
                    max_len - r.num_tokens - 1)
    if steps < 2:
        return 0
    # Step 1 has its blocks already; step s >= 2 feeds position num_computed + s - 1.
    crossings = sorted(s for s, _ in _block_events(running, bm.block_size, 2, steps))
    free = bm.num_free_blocks
    if len(crossings) > free:
        steps = crossings[free] - 1  # that step's allocation would find no block: it preempts
    return steps if steps >= 2 else 0


def _admission_stays_blocked(sched: Scheduler, num_rows: int) -> bool:
    """True if the queue's head cannot be admitted now and no step of a run can change that."""
    cfg, bm = sched.config, sched.block_manager
    if len(sched.running) >= sched.max_num_seqs or cfg.max_num_batched_tokens - num_rows <= 0:
        return True
    # With prefix caching a run's newly hashed (or evicted) blocks change the head's hits.
    return not bm.enable_prefix_caching and not bm.can_allocate(sched.waiting[0])


def _block_events(rows: Sequence[Request], block_size: int, first: int, last: int
                  ) -> list[tuple[int, int]]:
    """(step, row) of each block allocation in steps first..last (numbered from the run's step 1).

    Step s of a row that had c computed tokens when step 1 was scheduled feeds position
    c + s - 1, so it needs a block when that position reaches the table's end, then every
    block_size steps.
    """
    events: list[tuple[int, int]] = []
    for i, r in enumerate(rows):
        s = len(r.block_table) * block_size - r.num_computed_tokens + 1
        if s < first:
            s += -(-(first - s) // block_size) * block_size
        events.extend((t, i) for t in range(s, last + 1, block_size))
    return events


def advance_decode_run(sched: Scheduler, rows: Sequence[Request], num_steps: int,
                       token_id: int, end_times_s: Sequence[float]) -> None:
    """Apply `num_steps` more steps of a run whose first step has been applied.

    `rows` are that step's decode rows; step k here (1-based) ends at end_times_s[k - 1]. The
    caller proved the steps with `decode_run_length` and has nothing in flight.
    """
    if num_steps <= 0:
        return
    bm = sched.block_manager
    bs, caching = bm.block_size, bm.enable_prefix_caching
    times = end_times_s[:num_steps]
    start = [r.num_computed_tokens for r in rows]
    for r in rows:  # the tokens first: hashing a block reads them
        r.output_token_ids.extend(repeat(token_id, num_steps))
        r.token_times_s.extend(times)
    # Step k's schedule allocates (order 0), then its update hashes full blocks (order 1): the
    # order step-by-step scheduling makes these calls in, which fixes block ids and evictions.
    events = [(s, 0, i) for s, i in _block_events(rows, bs, 1, num_steps)]
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
    sched.skip_steps(num_steps)
