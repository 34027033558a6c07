"""Measured evidence for the batching policy: the same interference probe under each policy.

Only an in-process target can be re-run under another policy. For each policy the engine is
rebuilt on the same weights (`chunked` with a small token budget, so a long prompt really is
split), warmed up, and given the interference probe: short streams decoding while long prompts
arrive. The result per policy is the streams' inter-token latency outside and during the
prefills, and their decode tokens/s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from splitphase.audit.probes import ProbePlan, PromptMaker, interference_requests
from splitphase.audit.steps.profile import measure_interference
from splitphase.audit.trace import ProbeRequest, RequestTrace

POLICIES = ("mixed", "chunked", "disaggregated")
CHUNKED_BUDGET_TOKENS = 64  # small enough that the probe's longest prompt spans several steps


@dataclass(frozen=True)
class PolicyResult:
    """One policy under the interference probe (None figures: it could not be measured)."""

    policy: str
    baseline_itl_s: float | None
    during_prefill_itl_s: float | None
    max_itl_s: float | None
    stream_tokens_per_s: float

    @property
    def measured(self) -> bool:
        return self.baseline_itl_s is not None and self.during_prefill_itl_s is not None


def _stream_rate(traces: Sequence[RequestTrace]) -> float:
    streams = [t for t in traces if t.role == "stream" and t.ok and t.end_s is not None]
    if not streams:
        return 0.0
    span = max(t.end_s or 0.0 for t in streams) - min(t.send_s for t in streams)
    return sum(len(t.token_times_s) for t in streams) / span if span > 0 else 0.0


def compare_policies(
    model: str, plan: ProbePlan, sweep: Sequence[RequestTrace], max_seq_len: int,
    policies: Sequence[str] = POLICIES,
    kv_cache_dtype: str = "auto",
) -> list[PolicyResult]:
    """Run the interference probe on `model` under each policy (in-process targets only)."""
    from splitphase.audit.targets.builtin import BuiltinTarget

    results = []
    for policy in policies:
        budget = CHUNKED_BUDGET_TOKENS if policy == "chunked" else max(2048, max_seq_len)
        target = BuiltinTarget(model, policy=policy, max_num_batched_tokens=budget,
                               kv_cache_dtype=kv_cache_dtype)
        try:
            maker = PromptMaker(target.codec())
            warm = [ProbeRequest(*maker.make(max(plan.prompt_lens)), plan.output_tokens, "warmup")]
            target.run(warm, 1)
            reqs = interference_requests(plan, maker, sweep, max_seq_len)
            traces = target.run(reqs, len(reqs))
        finally:
            target.close()
        inter = measure_interference(traces)
        if inter is None:  # the streams ended before a long prompt arrived: say so
            results.append(PolicyResult(policy, None, None, None, _stream_rate(traces)))
            continue
        results.append(PolicyResult(policy, inter.baseline_itl_s, inter.during_prefill_itl_s,
                                    inter.max_itl_s, _stream_rate(traces)))
    return results


def measured(results: Sequence[PolicyResult]) -> list[PolicyResult]:
    return [r for r in results if r.measured]


def _line(r: PolicyResult) -> str:
    if r.baseline_itl_s is None or r.during_prefill_itl_s is None or r.max_itl_s is None:
        return f"{r.policy}: not measured (its streams never overlapped a long prefill)"
    return (
        f"{r.policy}: {r.baseline_itl_s * 1e3:.1f} ms -> {r.during_prefill_itl_s * 1e3:.1f} ms "
        f"per token during a long prefill ({r.during_prefill_itl_s / r.baseline_itl_s:.2f}x, "
        f"worst {r.max_itl_s * 1e3:.1f} ms), streams {r.stream_tokens_per_s:,.0f} tok/s"
    )


def describe(results: Sequence[PolicyResult]) -> str:
    """One line per policy, for the report."""
    return "; ".join(_line(r) for r in results)
