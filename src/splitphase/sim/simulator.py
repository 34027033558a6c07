"""The discrete-event loop (a heapq of timed events, as in Vidur) over a simulated cluster.

Events: a request arrives (routed to a colocated or prefill replica), a replica's step ends
(tokens applied; prefilled requests start their KV transfer; a decode replica's preempted
requests go back to a prefill replica), a KV transfer ends (the prefill replica frees the
blocks, the decode replica takes the request). After every event the replicas it touched start
their next step if they are idle and have work: continuous batching, one step in flight each.
Each prefill replica sends one KV transfer at a time over its link (the transfer queue). An
optional dispatch delay models a front end's hop between a request's arrival and its replica.
A run may begin with warm-up requests: simulated like the rest, so the measured ones find
queues, batches and prefix caches as a running deployment has them, but left out of the
measured records, and the device time and replica totals are counted from the arrival of the
first measured request (`SimResult.measured_records`, `window_start_s`, `window`).
A replica may take a run of identical decode steps as one (`sim.replica`, fast-forward): a
request delivered to it cuts the run first, and the step-end event the run had pushed goes
stale (each replica's latest step event is the live one; stale ones are skipped).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from splitphase.engine.handoff import Handoff
from splitphase.engine.request import Request
from splitphase.hardware.specs import HardwareSpec
from splitphase.model.config import ModelConfig
from splitphase.sim.cluster import ClusterConfig, Replica, Router, build_pool
from splitphase.sim.cost_model import CostModel
from splitphase.sim.replica import make_request
from splitphase.sim.workload import SimRequest

_STEP, _XFER, _ADD = 0, 1, 2


@dataclass(frozen=True)
class RequestRecord:
    """One finished request's timeline in simulated seconds."""

    index: int
    arrival_s: float
    first_token_s: float
    finished_s: float
    prompt_len: int
    output_len: int
    num_preemptions: int

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (None for one-token outputs)."""
        if self.output_len < 2:
            return None
        return (self.finished_s - self.first_token_s) / (self.output_len - 1)

    @property
    def e2e_s(self) -> float:
        return self.finished_s - self.arrival_s


@dataclass(frozen=True)
class ReplicaTotals:
    """A replica's running totals: device busy time and prefix-cache lookups."""

    busy_s: float = 0.0
    prefill_busy_s: float = 0.0
    prefix_cache_queries_tokens: int = 0
    prefix_cache_hits_tokens: int = 0

    @classmethod
    def of(cls, r: Replica) -> ReplicaTotals:
        return cls(r.busy_s, r.prefill_busy_s, r.prefix_cache_queries_tokens,
                   r.prefix_cache_hits_tokens)

    def minus(self, earlier: ReplicaTotals) -> ReplicaTotals:
        return ReplicaTotals(
            self.busy_s - earlier.busy_s, self.prefill_busy_s - earlier.prefill_busy_s,
            self.prefix_cache_queries_tokens - earlier.prefix_cache_queries_tokens,
            self.prefix_cache_hits_tokens - earlier.prefix_cache_hits_tokens)


@dataclass
class SimResult:
    """Every finished request, plus per-replica busy time and step logs."""

    records: list[RequestRecord]
    replicas: list[Replica]
    makespan_s: float
    num_gpus: int
    kv_transfer_s: float = 0.0
    events: int = 0
    prefill_gpu_s: float = 0.0  # device-seconds attributed to prefill work (for cost by phase)
    decode_gpu_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)
    warmup: frozenset[int] = frozenset()  # indices of the requests that only warmed the run
    window_start_s: float = 0.0  # the first measured arrival (0: the whole run)
    window: dict[str, ReplicaTotals] = field(default_factory=dict)  # each replica's, since then

    @property
    def measured_records(self) -> list[RequestRecord]:
        """The records of the requests after the warm-up (all, without one)."""
        return [r for r in self.records if r.index not in self.warmup]


class Simulation:
    """One run of a cluster over a list of requests; `run()` returns a `SimResult`."""

    def __init__(self, cluster: ClusterConfig, model: ModelConfig, hardware: HardwareSpec,
                 record_steps: bool = False, dtype: str = "bfloat16", dtype_bytes: int = 2,
                 fast_forward: bool = True, kv_dtype_bytes: int | None = None,
                 weight_bytes_per_param: float | None = None) -> None:
        self.cluster = cluster
        base = CostModel(model, hardware, dtype=dtype, dtype_bytes=dtype_bytes,
                         kv_dtype_bytes=kv_dtype_bytes,
                         weight_bytes_per_param=weight_bytes_per_param)
        self.colocated: list[Replica] = []
        self.prefill: list[Replica] = []
        self.decode: list[Replica] = []
        if cluster.colocated is not None:
            self.colocated = build_pool("c", cluster.colocated, base, record_steps, fast_forward)
        if cluster.prefill is not None and cluster.decode is not None:
            self.prefill = build_pool("p", cluster.prefill, base, record_steps, fast_forward)
            self.decode = build_pool("d", cluster.decode, base, record_steps, fast_forward)
        self.front = Router(cluster.router, self.colocated or self.prefill)
        self.to_decode = Router(cluster.router, self.decode) if self.decode else None
        self._heap: list[tuple[float, int, int, object]] = []
        self._seq = itertools.count()
        self._step_seq: dict[str, int] = {}  # each replica's live step event (by heap seq)
        self._link_free_s: dict[str, float] = {r.name: 0.0 for r in self.prefill}
        self._records: list[RequestRecord] = []
        self._xfer_s = 0.0

    def run(self, requests: Sequence[SimRequest], warmup_requests: int = 0) -> SimResult:
        """Simulate until every request has finished; the first `warmup_requests` by arrival
        warm the cluster and are not measured."""
        reqs = sorted(requests, key=lambda r: r.arrival_s)
        i, n, events, now = 0, len(reqs), 0, 0.0
        if not 0 <= warmup_requests < max(n, 1):
            raise ValueError(f"{warmup_requests} warm-up requests of {n}: none left to measure")
        start, start_s, start_xfer_s = self._totals(), 0.0, 0.0
        heap = self._heap
        step_seq = self._step_seq
        while i < n or heap:
            if heap and (i >= n or heap[0][0] <= reqs[i].arrival_s):
                t, seq, kind, payload = heapq.heappop(heap)
                if kind == _STEP and step_seq[payload.name] != seq:  # type: ignore[attr-defined]
                    continue  # the end of a decode run that a delivery cut short: not an event
                events += 1
                now = t
                if kind == _STEP:
                    self._on_step(payload, now)  # type: ignore[arg-type]
                elif kind == _XFER:
                    self._on_transfer(payload, now)  # type: ignore[arg-type]
                else:
                    self._admit(payload, now)  # type: ignore[arg-type]
            else:
                events += 1
                sim = reqs[i]
                i += 1
                now = sim.arrival_s
                if warmup_requests and i == warmup_requests + 1:  # the first measured one
                    start, start_s, start_xfer_s = self._totals(), now, self._xfer_s
                if self.cluster.dispatch_s > 0:
                    self._push(now + self.cluster.dispatch_s, _ADD, sim)
                else:
                    self._admit(sim, now)
        end = self._totals()
        return self._result(
            SimResult(self._records, self._replicas(), now, self.cluster.num_gpus,
                      self._xfer_s - start_xfer_s, events,
                      warmup=frozenset(r.index for r in reqs[:warmup_requests]),
                      window_start_s=start_s, window={k: end[k].minus(start[k]) for k in end}))

    def _result(self, result: SimResult) -> SimResult:
        """`result` with its device time from the window's start on, split by phase."""
        span_s = result.makespan_s - result.window_start_s
        replicas = result.replicas
        for r in replicas:
            tp, w = r.cost.tp, result.window[r.name]
            if r.role == "prefill":
                result.prefill_gpu_s += tp * span_s
            elif r.role == "decode":
                result.decode_gpu_s += tp * span_s
            else:  # split a colocated replica's measured time by its busy-time phase mix
                share = w.prefill_busy_s / w.busy_s if w.busy_s > 0 else 0.0
                result.prefill_gpu_s += tp * span_s * share
                result.decode_gpu_s += tp * span_s * (1 - share)
        return result

    def _replicas(self) -> list[Replica]:
        return self.colocated + self.prefill + self.decode

    def _totals(self) -> dict[str, ReplicaTotals]:
        return {r.name: ReplicaTotals.of(r) for r in self._replicas()}

    def _admit(self, sim: SimRequest, now_s: float) -> None:
        self._deliver(self.front.pick(), make_request(sim), now_s)

    def _deliver(self, replica: Replica, request: Request, now_s: float) -> None:
        """Queue `request` at `replica` (cutting its decode run at `now_s`) and kick it."""
        if replica.run is not None:
            end = replica.cut(now_s)
            if end is None:
                self._step_seq[replica.name] = -1  # the run ended just now: its event is void
            else:
                self._push_step(replica, end)
        replica.add(request)
        self._kick(replica, now_s)

    def _push(self, time_s: float, kind: int, payload: object) -> None:
        heapq.heappush(self._heap, (time_s, next(self._seq), kind, payload))

    def _push_step(self, replica: Replica, end_s: float) -> None:
        seq = next(self._seq)
        self._step_seq[replica.name] = seq
        heapq.heappush(self._heap, (end_s, seq, _STEP, replica))

    def _kick(self, replica: Replica, now_s: float) -> None:
        end = replica.start_step(now_s)
        if end is not None:
            self._push_step(replica, end)

    def _on_step(self, replica: Replica, now_s: float) -> None:
        if (end := replica.continue_run(now_s)) is not None:
            self._push_step(replica, end)  # the next priced stretch of a decode run
            return
        finished, handoffs = replica.finish_step(now_s)
        for req in finished:
            self._record(req, now_s)
        for h in handoffs:
            if replica.role == "prefill":
                self._start_transfer(replica, h, now_s)
            else:  # preempted on a decode replica: a fresh prefill on a prefill replica
                self._deliver(self.front.pick(), h.request, now_s)
        self._kick(replica, now_s)

    def _start_transfer(self, src: Replica, h: Handoff, now_s: float) -> None:
        start = max(now_s, self._link_free_s[src.name])
        dur = src.cost.kv_transfer_s(h.num_computed_tokens, self.cluster.link)
        self._link_free_s[src.name] = start + dur
        self._xfer_s += dur
        self._push(start + dur, _XFER, (src, h))

    def _on_transfer(self, payload: tuple[Replica, Handoff], now_s: float) -> None:
        src, h = payload
        src.scheduler.release_handoff(h.request.request_id)
        assert self.to_decode is not None
        self._deliver(self.to_decode.pick(), h.request, now_s)
        self._kick(src, now_s)  # freed blocks may let a waiting prompt in

    def _record(self, req: Request, now_s: float) -> None:
        first = req.first_token_s if req.first_token_s is not None else now_s
        self._records.append(RequestRecord(
            int(req.request_id[1:]), req.arrival_time_s, first, now_s,
            req.num_prompt_tokens, req.num_output_tokens, req.num_preemptions,
        ))


def simulate(cluster: ClusterConfig, model: ModelConfig, hardware: HardwareSpec,
             requests: Sequence[SimRequest], record_steps: bool = False,
             dtype: str = "bfloat16", dtype_bytes: int = 2, fast_forward: bool = True,
             kv_dtype_bytes: int | None = None, weight_bytes_per_param: float | None = None,
             warmup_requests: int = 0) -> SimResult:
    """Run `requests` through `cluster` and return what happened.

    fast_forward=False steps every decode through the scheduler (the same results, slower);
    kv_dtype_bytes: the K/V cache's width (None: dtype_bytes); weight_bytes_per_param:
    quantized weights' (None: dtype_bytes), with dtype their matmuls' dtype;
    warmup_requests: how many of the first requests only warm the cluster (`Simulation.run`).
    """
    return Simulation(cluster, model, hardware, record_steps, dtype, dtype_bytes, fast_forward,
                      kv_dtype_bytes, weight_bytes_per_param).run(requests, warmup_requests)
