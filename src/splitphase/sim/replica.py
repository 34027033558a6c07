"""One simulated replica: the engine's own `Scheduler` and `BlockManager`, timed by a cost model.

The replica does exactly what `LLMEngine.step` does around the model: `schedule(now)`, run the
batch (here: advance simulated time by the cost model's step time), then
`update_from_output(out, sampled, now)` with one sampled token per sampling row. The sampled
token is a fixed id and requests ignore EOS, so each request stops at its output length, as a
trace replay does.

Fast-forward: when the scheduler's step decodes every running request and
`engine.decode_run.decode_run_length` proves the next steps would be the same step again, the
replica prices the whole run at once and the simulator sees one step that ends where the run
does; the steps after the first are applied together when it ends. Anything added to the
replica meanwhile (an arrival, a transfer) first `cut`s the run where it stands: the steps ended
by then are applied and the one in flight is scheduled by the scheduler itself, so a replica is
never ahead of an event that could change its decisions. No request finishes inside a run, so
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
# Steps priced when a run starts. Arrivals cut most runs well before this (a busy replica sees
# one every ~20 steps); a run that reaches it simply starts again from a scheduled step.
MAX_RUN_STEPS = 64


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
    """Steps 1..K of a run: step 1 is the scheduler's output in flight, the rest repeat it."""

    rows: list[Request]  # step 1's decode rows (the running list), in order
    ends_s: list[float]  # when each step ends, step 1 first
    durations_s: list[float]  # steps 2..K (step 1's is counted when it starts)


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
        self.run: DecodeRun | None = None  # when the step in flight starts a decode run
        self.busy_s = 0.0
        self.prefill_busy_s = 0.0  # busy time attributed to prefill work (for cost by phase)
        self.num_steps = 0
        self.outstanding = 0  # requests routed here that have not left (load for routing)
        self.steps: list[StepSummary] | None = [] if record_steps else None

    def add(self, request: Request) -> None:
        """Queue a new or handed-back request (a decode replica takes prefilled ones).

        With a decode run in flight, `cut` it at the current time first.
        """
        if self.run is not None:
            raise RuntimeError(f"{self.name}: a decode run is in flight; cut() it first")
        if self.role == "decode":
            self.scheduler.add_prefilled_request(request)
        else:
            self.scheduler.add_request(request)
        self.outstanding += 1

    def start_step(self, now_s: float) -> float | None:
        """Schedule a step (or a decode run) at `now_s`; return when it ends, or None if idle."""
        return self._start(now_s, self.fast_forward)

    def _start(self, now_s: float, allow_run: bool) -> float | None:
        if self.in_flight is not None or not self.scheduler.has_unfinished_requests():
            return None
        out = self.scheduler.schedule(now_s)
        if not out.num_seqs:
            return None
        t = self.cost.step_time_of(out)
        self.in_flight = out
        self.busy_s += t.total_s
        self.prefill_busy_s += t.total_s * t.prefill_share
        self.num_steps += 1
        if self.steps is not None:
            self.steps.append(StepSummary.of(out, t.total_s))
        end_s = now_s + t.total_s
        if allow_run:
            k = decode_run_length(self.scheduler, out, SAMPLED_TOKEN_ID, MAX_RUN_STEPS)
            if k >= 2:
                durations = self.cost.decode_steps_s(out.decode.positions, 1, k - 1)
                ends = [end_s]
                for d in durations:  # the same additions as one step after another
                    end_s = end_s + d
                    ends.append(end_s)
                self.run = DecodeRun(list(self.scheduler.running), ends, durations)
        return end_s

    def finish_step(self, now_s: float) -> tuple[list[Request], list[Handoff]]:
        """Apply the in-flight step's tokens at `now_s`: (finished requests, handoffs out)."""
        if self.run is not None:
            self._apply_run(len(self.run.ends_s))  # nothing finishes or leaves inside a run
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
        event loop orders a step end before an arrival at the same time) and the next one is
        scheduled by the scheduler where it started. None: the whole run had ended.
        """
        run = self.run
        if run is None:
            raise RuntimeError(f"{self.name}: no decode run to cut")
        done = bisect_right(run.ends_s, now_s)
        if done == 0:
            self.run = None  # step 1, the scheduler's own output, stays in flight
            return run.ends_s[0]
        self._apply_run(done)
        if done == len(run.ends_s):
            return None
        end_s = self._start(run.ends_s[done - 1], allow_run=False)
        if end_s != run.ends_s[done]:
            raise RuntimeError(f"{self.name}: the scheduler left the decode run at step {done}")
        return end_s

    def _apply_run(self, num_steps: int) -> None:
        """Apply the run's steps 1..num_steps (step 1 through the scheduler's own update)."""
        run, out = self.run, self.in_flight
        assert run is not None and out is not None
        self.run = self.in_flight = None
        tok = [SAMPLED_TOKEN_ID]
        ids = out.decode.request_ids
        if self.scheduler.update_from_output(out, dict.fromkeys(ids, tok), run.ends_s[0]):
            raise AssertionError(f"{self.name}: a request finished in a decode run's first step")
        more = num_steps - 1
        advance_decode_run(self.scheduler, run.rows, more, SAMPLED_TOKEN_ID, run.ends_s[1:])
        for d in run.durations_s[:more]:  # summed one by one, as step after step would
            self.busy_s += d
        self.num_steps += more
        if self.steps is not None:
            self.steps.extend(StepSummary(out.step_id + k, (), ids, (), run.durations_s[k - 1])
                              for k in range(1, num_steps))
