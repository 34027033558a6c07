"""One simulated replica: the engine's own `Scheduler` and `BlockManager`, timed by a cost model.

The replica does exactly what `LLMEngine.step` does around the model: `schedule(now)`, run the
batch (here: advance simulated time by the cost model's step time), then
`update_from_output(out, sampled, now)` with one sampled token per sampling row. The sampled
token is a fixed id and requests ignore EOS, so each request stops at its output length, as a
trace replay does.

Fast-forward: when `engine.decode_run.decode_run_length` proves that the next steps would each
decode every running request and nothing else, the replica runs them as one decode run: it
prices them (a stretch at a time) and the simulator sees one event per stretch; their tokens
are applied together when the run ends. Anything added to the replica meanwhile (an arrival, a
transfer) first `cut`s the run where it stands: the steps ended by then are applied, the one in
flight finishes as priced (an addition only queues, so it cannot change a step already
scheduled), and the scheduler decides the step after it. No request finishes inside a run, so
the load a router reads (`outstanding`) is exact at any time.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

from splitphase.engine.decode_run import advance_decode_run, decode_run_length
from splitphase.engine.handoff import Handoff
from splitphase.engine.request import Request
from splitphase.engine.sampling_params import SamplingParams
from splitphase.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from splitphase.sim.cost_model import CostModel
from splitphase.sim.workload import TRACE_BLOCK_TOKENS, SimRequest

SAMPLED_TOKEN_ID = 1  # what the simulated sampler returns (EOS is ignored)
MAX_RUN_STEPS = 4096  # a longer proved run is applied and proved again
# Steps priced ahead at once: an arrival cuts a run every ~20 steps on a busy replica, and
# steps priced past a cut are wasted; each stretch costs one event.
RUN_STRETCH_STEPS = 16


@dataclass(frozen=True)
class StepSummary:
    """What one step ran: chunks (request, start, tokens), decodes, preemptions, its time."""

    step_id: int
    chunks: tuple[tuple[str, int, int], ...]
    decodes: tuple[str, ...]
    preempted: tuple[str, ...]
    duration_s: float

    @classmethod
    def of(cls, out: SchedulerOutput, duration_s: float) -> StepSummary:
        return cls(
            out.step_id,
            tuple((c.request_id, c.start, c.num_tokens) for c in out.prefill),
            out.decode.request_ids,
            out.preempted_request_ids,
            duration_s,
        )


def prompt_token_ids(sim: SimRequest) -> list[int]:
    """Token ids whose 512-token blocks follow the trace's hash_ids, so equal ids share KV.

    Without hash ids every request gets its own ids (no accidental prefix hits).
    """
    n, bt = sim.prompt_len, TRACE_BLOCK_TOKENS
    if not sim.hash_ids:
        base = (sim.index + 1) * 1_000_003
        return list(range(base, base + n))
    ids: list[int] = []
    for h in sim.hash_ids:
        start = (h + 1) * bt
        ids.extend(range(start, start + min(bt, n - len(ids))))
        if len(ids) >= n:
            break
    if len(ids) < n:  # the trace listed fewer blocks than the prompt holds: unique tail
        base = 2**40 + sim.index * 1_000_003
        ids.extend(range(base, base + n - len(ids)))
    return ids


def make_request(sim: SimRequest) -> Request:
    """The engine `Request` of a simulated one."""
    params = SamplingParams(max_tokens=sim.output_len, ignore_eos=True)
    return Request(f"r{sim.index}", prompt_token_ids(sim), params, sim.arrival_s)


@dataclass
class DecodeRun:
    """Steps first_step..last_step of a proved decode run, not yet applied; some priced."""

    rows: list[Request]  # the running list when the run was proved, in order
    positions: list[int]  # their num_computed_tokens then (step k feeds position + k - 1)
    last_step: int
    ends_s: list[float]  # when each priced step ends, from first_step on
    durations_s: list[float]
    first_step: int = 1


class Replica:
    """A scheduler instance with its cost model; one step (or one decode run) in flight."""

    def __init__(self, name: str, config: SchedulerConfig, cost: CostModel,
                 record_steps: bool = False, fast_forward: bool = True) -> None:
        self.name = name
        self.scheduler = Scheduler(config)
        self.cost = cost
        self.role = config.role
        self.fast_forward = fast_forward and self.role != "prefill"  # prefill workers never decode
        self.in_flight: SchedulerOutput | None = None
        self.run: DecodeRun | None = None
        self.busy_s = 0.0
        self.prefill_busy_s = 0.0  # busy time attributed to prefill work (for cost by phase)
        self.num_steps = 0
        self.prefix_cache_queries_tokens = 0  # admissions' prompt tokens looked up
        self.prefix_cache_hits_tokens = 0  # of those, found in the prefix cache
        self.outstanding = 0  # requests routed here that have not left (load for routing)
        self.steps: list[StepSummary] | None = [] if record_steps else None

    def add(self, request: Request) -> None:
        """Queue a new or handed-back request (a decode replica takes prefilled ones).

        A decode run in flight must be `cut` at the current time first.
        """
        if self.run is not None and self.run.last_step > self.run.first_step:
            raise RuntimeError(f"{self.name}: a decode run is in flight; cut() it first")
        if self.role == "decode":
            self.scheduler.add_prefilled_request(request)
        else:
            self.scheduler.add_request(request)
        self.outstanding += 1

    def start_step(self, now_s: float) -> float | None:
        """Schedule a step (or a decode run) at `now_s`; return when it ends, or None if idle."""
        if self.in_flight is not None or self.run is not None:
            return None
        if not self.scheduler.has_unfinished_requests():
            return None
        if self.fast_forward:
            k = decode_run_length(self.scheduler, SAMPLED_TOKEN_ID, MAX_RUN_STEPS)
            if k:
                rows = list(self.scheduler.running)
                positions = [r.num_computed_tokens for r in rows]
                self.run = DecodeRun(rows, positions, k, [], [])
                return self._price(now_s)
        out = self.scheduler.schedule(now_s)
        self.prefix_cache_queries_tokens += out.prefix_cache_queries_tokens
        self.prefix_cache_hits_tokens += out.prefix_cache_hits_tokens
        if not out.num_seqs:
            return None
        t = self.cost.step_time_of(out)
        self.in_flight = out
        self.busy_s += t.total_s
        self.prefill_busy_s += t.total_s * t.prefill_share
        self.num_steps += 1
        if self.steps is not None:
            self.steps.append(StepSummary.of(out, t.total_s))
        return now_s + t.total_s

    def _price(self, now_s: float) -> float:
        """Price the run's next stretch from `now_s`, when its last priced step ended."""
        run = self.run
        assert run is not None
        first = run.first_step + len(run.ends_s)
        last = min(run.last_step, first + RUN_STRETCH_STEPS - 1)
        durations = self.cost.decode_steps_s(run.positions, first - 1, last - 1)
        end_s = now_s
        for d in durations:  # the same additions as one step after another
            end_s = end_s + d
            run.ends_s.append(end_s)
        run.durations_s += durations
        return end_s

    def continue_run(self, now_s: float) -> float | None:
        """At the end of a priced stretch: price the next one and return its end (None: done)."""
        run = self.run
        if run is None or run.first_step + len(run.ends_s) > run.last_step:
            return None
        return self._price(now_s)

    def finish_step(self, now_s: float) -> tuple[list[Request], list[Handoff]]:
        """Apply the in-flight step's tokens at `now_s`: (finished requests, handoffs out)."""
        if self.run is not None:
            self._apply_run(len(self.run.ends_s))  # nothing finishes or leaves inside a run
            self.run = None
            return [], []
        out, self.in_flight = self.in_flight, None
        if out is None:
            raise RuntimeError(f"{self.name}: no step in flight")
        tok = [SAMPLED_TOKEN_ID]
        sampled = dict.fromkeys(out.decode.request_ids, tok)  # one token per decode
        sampled.update({c.request_id: tok * c.num_samples for c in out.prefill if c.is_last_chunk})
        finished = self.scheduler.update_from_output(out, sampled, now_s)
        handoffs = self.scheduler.pop_handoffs() if self.role is not None else []
        self.outstanding -= len(finished) + len(handoffs)
        return finished, handoffs

    def cut(self, now_s: float) -> float | None:
        """Stop the decode run in flight at `now_s`; return when the step then in flight ends.

        Steps that ended by `now_s` are applied (one ending at `now_s` comes first, as the
        event loop orders a step end before an arrival at the same time); the run keeps only
        the step in flight. None: every priced step had ended (the run is over).
        """
        run = self.run
        if run is None:
            raise RuntimeError(f"{self.name}: no decode run to cut")
        done = bisect_right(run.ends_s, now_s)
        if done == len(run.ends_s):  # only at a tie the event loop popped first (a dispatch)
            self.finish_step(now_s)  # unpriced proved steps are proved again at the next kick
            return None
        self._apply_run(done)
        run.last_step = run.first_step  # the step in flight is the run's last
        del run.ends_s[1:], run.durations_s[1:]
        return run.ends_s[0]

    def _apply_run(self, num_steps: int) -> None:
        """Apply the run's next `num_steps` priced steps and drop them from it."""
        run = self.run
        assert run is not None
        if num_steps <= 0:
            return
        first_id = advance_decode_run(self.scheduler, run.rows, num_steps, SAMPLED_TOKEN_ID,
                                      run.ends_s)
        durations = run.durations_s[:num_steps]
        for d in durations:  # summed one by one, as step after step would
            self.busy_s += d
        self.num_steps += num_steps
        if self.steps is not None:
            ids = tuple(r.request_id for r in run.rows)
            self.steps.extend(StepSummary(first_id + k, (), ids, (), d)
                              for k, d in enumerate(durations))
        run.first_step += num_steps
        del run.ends_s[:num_steps], run.durations_s[:num_steps]
