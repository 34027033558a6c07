"""Step 5: dollars per million input and output tokens, now and at achievable utilization.

Each phase is charged for the time it occupies the hardware at the rate measured at its
headline point; the bill of a stated workload is the busy time it needs, priced per hour.
"Achievable" is the binding resource at a stated share of peak that good software reaches;
where the target already does better, its measured rate is kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from splitphase.audit.steps.utilization import Utilization
from splitphase.errors import UserError

SECONDS_PER_HOUR = 3600.0
DAYS_PER_MONTH = 30.0
# Assumptions, not measurements: well-tuned GEMMs reach about 60% of dense peak on long
# prefills, and memory-bound decode kernels about 80% of peak bandwidth (gpt-fast reports
# ~80-90% MBU on H100s).
ACHIEVABLE_PREFILL_UTILIZATION = 0.6
ACHIEVABLE_DECODE_UTILIZATION = 0.8


@dataclass(frozen=True)
class Workload:
    """The stated workload the monthly bill is for."""

    requests_per_day: float
    prompt_tokens: float
    output_tokens: float

    def __post_init__(self) -> None:
        if self.requests_per_day < 0 or self.prompt_tokens < 0 or self.output_tokens < 0:
            raise UserError("the cost workload needs requests/day and token counts >= 0")


@dataclass(frozen=True)
class Rates:
    """Prefill and decode tokens/s and their dollar prices."""

    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    usd_per_million_input_tokens: float
    usd_per_million_output_tokens: float
    monthly_usd: float
    monthly_hours: float


@dataclass(frozen=True)
class Cost:
    """Step 5: rates and bills now and at achievable utilization, with the assumptions."""

    price_usd_per_hour: float
    workload: Workload
    now: Rates
    achievable: Rates
    achievable_prefill_utilization: float
    achievable_decode_utilization: float
    assumptions: tuple[str, ...] = field(default=())

    @property
    def monthly_savings_usd(self) -> float:
        return self.now.monthly_usd - self.achievable.monthly_usd

    @property
    def savings_fraction(self) -> float:
        return self.monthly_savings_usd / self.now.monthly_usd if self.now.monthly_usd else 0.0


def _rates(prefill_tps: float, decode_tps: float, price: float, work: Workload) -> Rates:
    usd_per_s = price / SECONDS_PER_HOUR
    busy_s_per_day = work.requests_per_day * (
        work.prompt_tokens / prefill_tps + work.output_tokens / decode_tps
    )
    hours = busy_s_per_day * DAYS_PER_MONTH / SECONDS_PER_HOUR
    return Rates(
        prefill_tokens_per_s=prefill_tps,
        decode_tokens_per_s=decode_tps,
        usd_per_million_input_tokens=usd_per_s / prefill_tps * 1e6,
        usd_per_million_output_tokens=usd_per_s / decode_tps * 1e6,
        monthly_usd=hours * price,
        monthly_hours=hours,
    )


def cost(
    util: Utilization,
    price_usd_per_hour: float,
    workload: Workload,
    achievable_prefill: float = ACHIEVABLE_PREFILL_UTILIZATION,
    achievable_decode: float = ACHIEVABLE_DECODE_UTILIZATION,
) -> Cost:
    """Step 5 from the headline rates of both phases."""
    if price_usd_per_hour < 0:
        raise UserError(f"--price-per-hour must be >= 0, got {price_usd_per_hour}")
    pre, dec = util.prefill.headline, util.decode.headline
    now = _rates(pre.tokens_per_s, dec.tokens_per_s, price_usd_per_hour, workload)
    best = _rates(
        max(pre.tokens_per_s, pre.tokens_per_s_at_full * achievable_prefill),
        max(dec.tokens_per_s, dec.tokens_per_s_at_full * achievable_decode),
        price_usd_per_hour,
        workload,
    )
    assumptions = (
        f"price ${price_usd_per_hour:.2f} per hour, billed only for busy time (no idle capacity)",
        f"prefill at the rate measured at {pre.point} ({pre.tokens_per_s:,.0f} tokens/s); "
        "longer prompts cost more per token (attention grows with length)",
        f"decode at the rate measured at {dec.point} ({dec.tokens_per_s:,.1f} tokens/s over "
        f"{dec.batch:.0f} stream(s))",
        f"achievable: prefill at {achievable_prefill:.0%} of peak FLOP/s and decode at "
        f"{achievable_decode:.0%} of the binding resource's peak, the same batch and lengths",
        f"workload: {workload.requests_per_day:,.0f} requests/day of "
        f"{workload.prompt_tokens:,.0f} prompt + {workload.output_tokens:,.0f} output tokens, "
        f"{DAYS_PER_MONTH:.0f} days a month",
    )
    return Cost(price_usd_per_hour, workload, now, best, achievable_prefill, achievable_decode,
                assumptions)
