"""Latency percentiles, throughput, SLO attainment and cost per million tokens of a run.

SLO attainment is DistServe's: the fraction of requests that meet both the TTFT and the TPOT
SLO. A configuration meets its SLOs at a rate when attainment >= the target (90% by default);
its goodput is the highest rate at which it does, divided by its GPUs (see planner.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from splitphase.errors import UserError
from splitphase.sim.simulator import RequestRecord, SimResult


@dataclass(frozen=True)
class SLO:
    """Latency targets and the fraction of requests that must meet both."""

    ttft_s: float
    tpot_s: float
    attainment: float = 0.9

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise UserError(f"the {name[:4].upper()} SLO must be > 0 seconds, got {v}")
        if not 0 < self.attainment <= 1:
            raise UserError(f"SLO attainment must be in (0, 1], got {self.attainment}")

    def met_by(self, r: RequestRecord) -> bool:
        tpot = r.tpot_s
        return r.ttft_s <= self.ttft_s and (tpot is None or tpot <= self.tpot_s)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100] (numpy's default method)."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _pcts(values: Sequence[float]) -> dict[str, float]:
    return {f"p{q}_s": percentile(values, q) for q in (50, 90, 99)}


def _lengths(values: Sequence[int]) -> dict[str, float]:
    return {"mean": sum(values) / len(values), "p50": percentile(values, 50),
            "p90": percentile(values, 90), "max": max(values)}


def attainment(records: Sequence[RequestRecord], slo: SLO) -> float:
    """Fraction of requests meeting both SLOs."""
    return sum(1 for r in records if slo.met_by(r)) / len(records) if records else 0.0


def summarize(result: SimResult, slo: SLO, price_usd_per_hour: float) -> dict[str, object]:
    """JSON-ready metrics of one run's measured requests (after its warm-up, if any)."""
    recs = result.measured_records
    span_s = max(result.makespan_s - min(r.arrival_s for r in recs), 1e-12)
    in_tok = sum(r.prompt_len for r in recs)
    out_tok = sum(r.output_len for r in recs)
    att = attainment(recs, slo)
    gpu_usd_per_s = price_usd_per_hour / 3600
    span_gpu_s = result.prefill_gpu_s + result.decode_gpu_s
    # Device time is split by phase (a disaggregated pool is all one phase; a colocated
    # replica is split by its busy-time mix), then priced per token of that phase.
    window = result.window.values()
    queries = sum(w.prefix_cache_queries_tokens for w in window)
    pre_usd = result.prefill_gpu_s * gpu_usd_per_s
    dec_usd = result.decode_gpu_s * gpu_usd_per_s
    return {
        "requests": len(recs),
        # What was measured, in tokens: a trace's stretches differ, and its longest prompts
        # can size a plan (each one's prefill queues what arrives behind it).
        "prompt_tokens": _lengths([r.prompt_len for r in recs]),
        "output_tokens": _lengths([r.output_len for r in recs]),
        "ttft": _pcts([r.ttft_s for r in recs]),
        "tpot": _pcts([t for r in recs if (t := r.tpot_s) is not None]),
        "e2e": _pcts([r.e2e_s for r in recs]),
        "throughput_requests_per_s": len(recs) / span_s,
        "throughput_output_tokens_per_s": out_tok / span_s,
        "slo_attainment": att,
        "meets_slo": att >= slo.attainment,
        "preemptions": sum(r.num_preemptions for r in recs),
        # Prompt tokens found computed at admission (a trace's shared blocks); None: none
        # looked up (no prefix reuse in the workload, so the replicas cache none).
        "prefix_cache_hit_rate": (sum(w.prefix_cache_hits_tokens for w in window) / queries
                                  if queries else None),
        "kv_transfer_s_total": result.kv_transfer_s,
        "gpus": result.num_gpus,
        "gpu_hours": span_gpu_s / 3600,
        "usd_per_million_input_tokens": pre_usd / in_tok * 1e6 if in_tok else None,
        "usd_per_million_output_tokens": dec_usd / out_tok * 1e6 if out_tok else None,
        "usd_per_million_tokens": (pre_usd + dec_usd) / (in_tok + out_tok) * 1e6,
        "utilization": sum(result.window[r.name].busy_s * r.cost.tp for r in result.replicas)
        / max(span_gpu_s, 1e-12),
    }
