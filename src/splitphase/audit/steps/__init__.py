"""The audit's five steps as pure functions of traces, model config, hardware spec and price.

1. `profile` (traces)  3. `utilization` (profile, config, hardware)  2. `bottleneck` (its
headline levels, hardware)  4. `optimizations` (profile, utilization, config, hardware)
5. `cost` (utilization, price).
`run_steps` chains them into one `AuditResult`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitphase.audit.steps.cost import Cost, Workload, cost
from splitphase.audit.steps.optimizations import (
    NOT_STATED,
    Optimization,
    ServingLimits,
    optimizations,
)
from splitphase.audit.steps.profile import Profile, Stats, profile
from splitphase.audit.steps.utilization import (
    GAP_THRESHOLD,
    Bottleneck,
    PhaseLevel,
    PhaseResult,
    Utilization,
    bottleneck,
    utilization,
)
from splitphase.audit.trace import RequestTrace
from splitphase.audit.weights import WeightFormat
from splitphase.hardware.specs import HardwareSpec
from splitphase.model.config import ModelConfig

if TYPE_CHECKING:
    from splitphase.audit.policies import PolicyResult

__all__ = [
    "GAP_THRESHOLD", "AuditResult", "Bottleneck", "Cost", "Optimization", "PhaseLevel",
    "PhaseResult", "Profile", "ServingLimits", "Stats", "Utilization", "Workload", "bottleneck",
    "cost",
    "optimizations", "profile", "run_steps", "utilization",
]


@dataclass(frozen=True)
class AuditResult:
    """All five steps' results for one target."""

    profile: Profile
    bottleneck: dict[str, Bottleneck]
    utilization: Utilization
    optimizations: list[Optimization]
    cost: Cost


def run_steps(
    traces: Sequence[RequestTrace],
    cfg: ModelConfig,
    hw: HardwareSpec,
    price_usd_per_hour: float,
    workload: Workload,
    policy_results: Sequence[PolicyResult] = (),
    current_policy: str | None = None,
    kv_dtype_bytes: int | None = None,
    limits: ServingLimits = NOT_STATED,
    weights: WeightFormat | None = None,
) -> AuditResult:
    """Steps 1 to 5 in order (policy_results: our engine re-run under each batching policy;
    kv_dtype_bytes: the target's K/V cache width, None for the model's; limits: the pool and
    sequence limit it states; weights: how it stores its weights, None for the model's dtype)."""
    prof = profile(traces)
    util = utilization(prof, cfg, hw, kv_dtype_bytes, weights)
    return AuditResult(
        profile=prof,
        bottleneck=bottleneck(util, hw),
        utilization=util,
        optimizations=optimizations(prof, util, cfg, hw, policy_results, current_policy,
                                    limits),
        cost=cost(util, price_usd_per_hour, workload),
    )
