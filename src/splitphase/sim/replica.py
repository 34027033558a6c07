"""One simulated replica: the engine's own `Scheduler` and `BlockManager`, timed by a cost model.

The replica does exactly what `LLMEngine.step` does around the model: `schedule(now)`, run the
batch (here: advance simulated time by the cost model's step time), then
`update_from_output(out, sampled, now)` with one sampled token per sampling row. The sampled
token is a fixed id and requests ignore EOS, so each request stops at its output length, as a
trace replay does.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitphase.engine.handoff import Handoff
from splitphase.engine.request import Request
from splitphase.engine.sampling_params import SamplingParams
from splitphase.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from splitphase.sim.cost_model import CostModel
from splitphase.sim.workload import TRACE_BLOCK_TOKENS, SimRequest

SAMPLED_TOKEN_ID = 1  # what the simulated sampler returns (EOS is ignored)


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


class Replica:
    """A scheduler instance with its cost model; one step in flight at a time."""

    def __init__(self, name: str, config: SchedulerConfig, cost: CostModel,
                 record_steps: bool = False) -> None:
        self.name = name
        self.scheduler = Scheduler(config)
        self.cost = cost
        self.role = config.role
        self.in_flight: SchedulerOutput | None = None
        self.busy_s = 0.0
        self.prefill_busy_s = 0.0  # busy time attributed to prefill work (for cost by phase)
        self.num_steps = 0
        self.outstanding = 0  # requests routed here that have not left (load for routing)
        self.steps: list[StepSummary] | None = [] if record_steps else None

    def add(self, request: Request) -> None:
        """Queue a new or handed-back request (a decode replica takes prefilled ones)."""
        if self.role == "decode":
            self.scheduler.add_prefilled_request(request)
        else:
            self.scheduler.add_request(request)
        self.outstanding += 1

    def start_step(self, now_s: float) -> float | None:
        """Schedule a step at `now_s`; return when it ends, or None if nothing can run."""
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
        return now_s + t.total_s

    def finish_step(self, now_s: float) -> tuple[list[Request], list[Handoff]]:
        """Apply the in-flight step's tokens at `now_s`: (finished requests, handoffs out)."""
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
