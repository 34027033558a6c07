"""The planner: goodput per GPU of every candidate unit, then the cheapest deployment for a rate.

DistServe's method (Zhong et al., OSDI 2024): a unit is one colocated replica (policy, TP,
batch limits) or one disaggregated group (P prefill and D decode replicas, each with its TP).
Its goodput is the highest request rate at which SLO attainment stays >= the target, found by
simulating the workload at growing rates and bisecting; goodput per GPU compares units of any
size. A unit serves a rate R with ceil(R / goodput) copies; the cheapest feasible deployment is
then simulated at R as a whole cluster (router included) to check it really meets the SLOs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from splitphase.audit.weights import WeightFormat
from splitphase.engine.scheduler import SchedulerConfig
from splitphase.errors import UserError
from splitphase.hardware.specs import HardwareSpec, LinkSpec, get_link
from splitphase.model.config import ModelConfig
from splitphase.sim.cluster import ClusterConfig, PoolConfig
from splitphase.sim.cost_model import CostModel, CostModelError, Efficiency
from splitphase.sim.metrics import SLO, attainment, summarize
from splitphase.sim.simulator import SimResult, simulate
from splitphase.sim.workload import SimRequest, WorkloadSpec

BLOCK_SIZE = 16


@dataclass(frozen=True)
class SearchSpace:
    """Which units the planner tries."""

    policies: tuple[str, ...] = ("mixed", "chunked", "disaggregated")
    tps: tuple[int, ...] = (1, 2, 4, 8)
    chunk_budgets: tuple[int, ...] = (256, 512, 1024, 2048)
    mixed_max_num_seqs: tuple[int, ...] = (64, 256)
    max_num_seqs: int = 256
    disagg_ratios: tuple[tuple[int, int], ...] = ((1, 1), (1, 2), (2, 1), (1, 3), (3, 1), (2, 3))
    disagg_tps: tuple[tuple[int, int], ...] = ((1, 1), (2, 1), (1, 2), (2, 2))
    prefill_budget: int = 8192
    max_unit_gpus: int = 8


@dataclass(frozen=True)
class PlanInputs:
    """Everything one planning run needs."""

    model: ModelConfig
    hardware: HardwareSpec
    workload: WorkloadSpec
    rate_per_s: float
    slo: SLO
    max_gpus: int = 64
    num_requests: int = 200
    seed: int = 0
    link: LinkSpec = field(default_factory=lambda: get_link("nvlink"))
    router: str = "least_loaded"
    efficiency: Efficiency = field(default_factory=Efficiency)
    space: SearchSpace = field(default_factory=SearchSpace)
    bisect_steps: int = 4
    max_requests_factor: int = 20  # a goodput probe simulates at most this many x num_requests
    length_cap: int | None = None  # prompt + output tokens per request; None: the model context
    kv_dtype_bytes: int | None = None  # the K/V cache's width (fp8: 1); None: the model's
    weights: WeightFormat | None = None  # quantized weights; None: bf16, as the activations
    # Requests simulated ahead of each probe's measured ones, as a fraction of them: a run that
    # starts empty lets its first requests through unqueued and finds prefix caches cold.
    warmup_fraction: float = 0.2

    def __post_init__(self) -> None:
        if not (math.isfinite(self.warmup_fraction) and 0 <= self.warmup_fraction <= 1):
            raise UserError(f"the warm-up fraction must be in [0, 1], got {self.warmup_fraction}")
        held, need = len(self.workload.trace), self.requests_with_warmup(self.num_requests)
        if 0 < held < need:
            raise UserError(
                f"the trace holds {held} requests from request {self.workload.trace_start} on,"
                f" fewer than {self.num_requests} to measure and their warm-up ({need} in all);"
                " lower --num-requests or the trace's start=")

    def requests_with_warmup(self, num_requests: int) -> int:
        """`num_requests` to measure and the warm-up simulated ahead of them."""
        return num_requests + math.ceil(num_requests * self.warmup_fraction)

    def weight_kwargs(self) -> dict[str, Any]:
        """The cost model's dtype and weight width for quantized weights (none: its defaults)."""
        w = self.weights
        if w is None:
            return {}
        return {"dtype": w.compute_dtype, "weight_bytes_per_param": w.bytes_per_param}

    def horizon_s(self) -> float:
        """Arrival span a probe should cover so queueing shows in its latencies, not only the
        start-up transient: twice one request's latency budget. Probes stay below the unit's
        measured capacity (`saturation_rate`), so a short span cannot hide an overload."""
        return 2 * (self.slo.ttft_s + self.workload.mean_output_len * self.slo.tpot_s)

    def probe_requests(self, rate_per_s: float) -> int | None:
        """Requests for a probe at `rate_per_s`: num_requests, more if the horizon needs them;
        None past max_requests_factor x num_requests."""
        need = max(self.num_requests, math.ceil(rate_per_s * self.horizon_s()))
        return None if need > self.num_requests * self.max_requests_factor else need


@dataclass
class Candidate:
    """One unit: its goodput search and what serving the target rate with it takes."""

    unit: ClusterConfig
    curve: list[tuple[float, float]] = field(default_factory=list)  # (rate, attainment)
    goodput_rate_per_s: float = 0.0
    at_goodput: dict[str, Any] | None = None
    copies: int | None = None
    verified: dict[str, Any] | None = None
    probe_limited: bool = False  # a probe used fewer requests than its horizon asked for
    capacity_rate_per_s: float = 0.0  # saturation throughput (the search's upper end)
    failing_rate_per_s: float | None = None  # the lowest probed rate that missed the SLOs

    def goodput_per_gpu_bounds(self) -> tuple[float, float]:
        """(found, ceiling) per GPU: goodput lies between the highest rate that met the SLOs
        and the lowest that did not (or the capacity the search starts from, which it never
        exceeds), so two candidates whose ranges overlap are a tie."""
        ceiling = self.failing_rate_per_s or self.capacity_rate_per_s
        return self.goodput_per_gpu, ceiling / self.unit_gpus

    @property
    def unit_gpus(self) -> int:
        return self.unit.num_gpus

    @property
    def goodput_per_gpu(self) -> float:
        return self.goodput_rate_per_s / self.unit_gpus

    @property
    def gpus_needed(self) -> int | None:
        return None if self.copies is None else self.copies * self.unit_gpus


def _max_len(inp: PlanInputs) -> int:
    return inp.length_cap or inp.model.max_seq_len


def _sched(inp: PlanInputs, cost: CostModel, policy: str, budget: int, seqs: int,
           role: str | None = None, max_model_len: int | None = None) -> SchedulerConfig:
    prefix = bool(inp.workload.trace) and any(r.hash_ids for r in inp.workload.trace)
    blocks = cost.num_kv_blocks(BLOCK_SIZE)
    cap = min(_max_len(inp), blocks * BLOCK_SIZE)
    return SchedulerConfig(
        policy=policy, role=role, max_num_seqs=min(seqs, budget), max_num_batched_tokens=budget,
        enable_prefix_caching=prefix, block_size=BLOCK_SIZE, num_blocks=blocks,
        max_model_len=min(cap, max_model_len or cap),
    )


def candidate_units(inp: PlanInputs, longest_request: int) -> list[ClusterConfig]:
    """Every unit of the search space that fits the model, the hardware and max_gpus."""
    sp, units = inp.space, []
    cap = min(sp.max_unit_gpus, inp.max_gpus)

    def cost(tp: int) -> CostModel | None:
        try:
            c = CostModel(inp.model, inp.hardware, tp, inp.efficiency,
                          kv_dtype_bytes=inp.kv_dtype_bytes, **inp.weight_kwargs())
            c.num_kv_blocks(BLOCK_SIZE)
            return c
        except CostModelError:
            return None

    def add(colocated: PoolConfig | None = None, prefill: PoolConfig | None = None,
            decode: PoolConfig | None = None) -> None:
        units.append(ClusterConfig(colocated, prefill, decode, inp.router, inp.link))

    for tp in (t for t in sp.tps if t <= cap):
        c = cost(tp)
        if c is None:
            continue
        if "mixed" in sp.policies:
            budget = max(longest_request, 2048)  # mixed runs whole prompts
            for seqs in sp.mixed_max_num_seqs:
                add(colocated=PoolConfig(1, tp, _sched(inp, c, "mixed", budget, seqs,
                                                       max_model_len=budget), inp.efficiency))
        if "chunked" in sp.policies:
            for budget in sp.chunk_budgets:
                add(colocated=PoolConfig(1, tp, _sched(inp, c, "chunked", budget,
                                                       sp.max_num_seqs), inp.efficiency))
    if "disaggregated" in sp.policies:
        for (tp_p, tp_d) in sp.disagg_tps:
            cp, cd = cost(tp_p), cost(tp_d)
            if cp is None or cd is None:
                continue
            for (n_p, n_d) in sp.disagg_ratios:
                if n_p * tp_p + n_d * tp_d > cap:
                    continue
                pre = _sched(inp, cp, "disaggregated", sp.prefill_budget, sp.max_num_seqs,
                             "prefill")
                dec = _sched(inp, cd, "disaggregated", sp.prefill_budget, sp.max_num_seqs,
                             "decode")
                add(prefill=PoolConfig(n_p, tp_p, pre, inp.efficiency),
                    decode=PoolConfig(n_d, tp_d, dec, inp.efficiency))
    return units


def saturation_rate(inp: PlanInputs, unit: ClusterConfig) -> float:
    """Requests/s the unit completes when it never runs dry (a burst of requests at once):
    its capacity. No rate above it can meet any SLO for long, so the search stays below it."""
    seats = sum(p.replicas * p.scheduler.max_num_seqs for p in unit.pools())
    n = max(inp.num_requests, min(2 * seats, 4 * inp.num_requests))
    reqs = inp.workload.with_rate(1e9).generate(n, inp.seed, _max_len(inp))
    res = simulate(unit, inp.model, inp.hardware, reqs, kv_dtype_bytes=inp.kv_dtype_bytes,
                   **inp.weight_kwargs())
    return n / max(res.makespan_s - reqs[0].arrival_s, 1e-12)


def run_at(inp: PlanInputs, cluster: ClusterConfig, rate_per_s: float, num_requests: int
           ) -> tuple[SimResult, list[SimRequest]]:
    """Simulate `cluster` on the workload at `rate_per_s`: `num_requests` measured, after
    `warmup_fraction` as many more that only warm it."""
    asked = inp.requests_with_warmup(num_requests)
    reqs = inp.workload.with_rate(rate_per_s).generate(asked, inp.seed, _max_len(inp))
    warmup = asked - num_requests
    if len(reqs) < asked:  # a trace ran out: the same share of it warms
        warmup = math.floor(len(reqs) * inp.warmup_fraction / (1 + inp.warmup_fraction))
    return simulate(cluster, inp.model, inp.hardware, reqs, kv_dtype_bytes=inp.kv_dtype_bytes,
                    warmup_requests=warmup, **inp.weight_kwargs()), reqs


def search_goodput(inp: PlanInputs, unit: ClusterConfig) -> Candidate:
    """Highest rate with SLO attainment >= target: grow or shrink by 2x, then bisect."""
    cand = Candidate(unit)

    def ok(rate: float) -> bool:
        n = inp.probe_requests(rate)
        if n is None:  # the horizon needs more requests than allowed: probe with the cap
            cand.probe_limited = True
            n = inp.num_requests * inp.max_requests_factor
        res, _ = run_at(inp, unit, rate, n)
        att = attainment(res.measured_records, inp.slo)
        cand.curve.append((rate, att))
        if att >= inp.slo.attainment and rate > cand.goodput_rate_per_s:
            cand.goodput_rate_per_s = rate
            cand.at_goodput = summarize(res, inp.slo, inp.hardware.price_usd_per_hour)
        if att < inp.slo.attainment:
            cand.failing_rate_per_s = min(rate, cand.failing_rate_per_s or math.inf)
        return att >= inp.slo.attainment

    # From the unit's capacity down by halves until the SLOs hold, then bisect.
    cand.capacity_rate_per_s = rate = saturation_rate(inp, unit)
    lo, hi = 0.0, rate
    for _ in range(10):
        if ok(rate):
            lo = rate
            break
        hi, rate = rate, rate / 2
    if lo == 0.0:
        return cand  # fails even at a trickle: the SLO cannot be met by this unit
    for _ in range(inp.bisect_steps if hi > lo else 0):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    cand.curve.sort()
    return cand


def verify(inp: PlanInputs, cand: Candidate) -> bool:
    """Size `cand` for the target rate, simulate the whole cluster at it; True if SLOs hold."""
    if cand.goodput_rate_per_s <= 0:
        return False
    copies = max(1, math.ceil(inp.rate_per_s / cand.goodput_rate_per_s))
    for _ in range(2):  # one more copy if routing imbalance costs attainment
        if copies * cand.unit_gpus > inp.max_gpus:
            return False
        cluster = cand.unit.scaled(copies)
        n = inp.probe_requests(inp.rate_per_s / copies) or inp.num_requests
        res, _ = run_at(inp, cluster, inp.rate_per_s, n * min(copies, 4))
        cand.copies = copies
        cand.verified = summarize(res, inp.slo, inp.hardware.price_usd_per_hour)
        measured = res.measured_records
        cand.verified["ttft_samples_s"] = [r.ttft_s for r in measured]
        cand.verified["tpot_samples_s"] = [t for r in measured if (t := r.tpot_s) is not None]
        if cand.verified["meets_slo"]:
            return True
        copies += 1
    return False


def run_plan(inp: PlanInputs, progress: Callable[[Iterable[Any]], Iterable[Any]] | None = None
             ) -> tuple[Candidate | None, list[Candidate]]:
    """Search every unit's goodput, then verify units from cheapest until one meets the SLOs."""
    # The largest probe draws a superset of every smaller probe's lengths (same seed), so its
    # longest request bounds them all; `mixed` needs a budget that holds it whole.
    biggest = inp.num_requests * inp.max_requests_factor
    probe = inp.workload.generate(inp.requests_with_warmup(biggest), inp.seed, _max_len(inp))
    longest = max(r.prompt_len + r.output_len for r in probe)
    inp = replace(inp, length_cap=longest)
    units = candidate_units(inp, longest)
    if not units:
        cap = min(inp.max_gpus, inp.space.max_unit_gpus)
        raise UserError(
            f"{inp.model.name} fits no configuration of up to {cap} x {inp.hardware.name}"
            f" (weights plus a KV cache, tensor parallelism"
            f" {', '.join(map(str, inp.space.tps))}); raise --max-gpus or pick larger hardware"
        )
    wrap = progress or (lambda it: it)
    cands = [search_goodput(inp, u) for u in wrap(units)]

    def est_gpus(c: Candidate) -> float:
        if c.goodput_rate_per_s <= 0:
            return math.inf
        return math.ceil(inp.rate_per_s / c.goodput_rate_per_s) * c.unit_gpus

    best = None
    for c in sorted(cands, key=lambda c: (est_gpus(c), -c.goodput_per_gpu)):
        if math.isinf(est_gpus(c)) or est_gpus(c) > inp.max_gpus:
            break
        if verify(inp, c):
            best = c
            break
    for group in (("mixed", "chunked"), ("disaggregated",)):  # distributions for the report
        top = max((c for c in cands if c.unit.policy in group and c.goodput_per_gpu > 0),
                  key=lambda c: c.goodput_per_gpu, default=None)
        if top is not None and top.verified is None:
            verify(inp, top)
    return best, cands


def with_space(inp: PlanInputs, **changes: Any) -> PlanInputs:
    """A copy of the inputs with a narrower search space (tests, --quick)."""
    return replace(inp, space=replace(inp.space, **changes))
