"""Step 1, profile: per-request prefill and decode times from traces, per probe point.

Prefill time is the server's when scraped, else TTFT minus the server's queue time, else TTFT.
Decode time is the inter-token gap. Requests of one point that overlap in time share the
hardware, so a point's prefill time is the union of its requests' prefill intervals, and its
decode batch is how many of its streams were decoding at each gap.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from splitphase.audit.trace import RequestTrace
from splitphase.errors import UserError


@dataclass(frozen=True)
class Stats:
    """Count, mean and percentiles of a set of durations, seconds."""

    n: int
    mean_s: float
    p50_s: float
    p90_s: float
    p99_s: float


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    if not values:
        raise ValueError("percentile of no values")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def stats(values: Sequence[float]) -> Stats:
    """`Stats` of a non-empty list of seconds."""
    return Stats(
        n=len(values),
        mean_s=statistics.fmean(values),
        p50_s=percentile(values, 50),
        p90_s=percentile(values, 90),
        p99_s=percentile(values, 99),
    )


@dataclass(frozen=True)
class PointProfile:
    """One probe point: requests sent together at one prompt length and concurrency."""

    point: str
    concurrency: int
    n: int
    prompt_tokens: float  # mean
    output_tokens: float  # mean
    ttft: Stats
    prefill: Stats
    itl: Stats
    prefill_busy_s: float  # union of the requests' prefill intervals
    prefill_overlap: float  # requests prefilling at once, on average (sum of times / union)
    decode_batch: float  # streams decoding at once, mean over gaps
    decode_context_tokens: float  # mean cached tokens per stream during decode
    decode_step_s: float  # p50 client gap, or the server's mean step time when scraped


@dataclass(frozen=True)
class Interference:
    """Inter-token gaps of running streams during and outside injected long prefills."""

    baseline_itl_s: float
    during_prefill_itl_s: float  # mean: a mixed step stalls one gap per stream, not the median
    max_itl_s: float
    spike: float  # mean gap during prefills over p50 gap outside them
    inject_prompt_tokens: float
    n_gaps_during: int


@dataclass(frozen=True)
class Profile:
    """Step 1's result: phase times overall, per point, the TTFT slope, and interference."""

    source: str  # "server" when scraped phase times were used, else "client"
    n_requests: int
    n_errors: int
    ttft: Stats
    prefill: Stats
    itl: Stats
    ttft_slope_s_per_token: float | None
    ttft_intercept_s: float | None
    ttft_fit_r2: float | None
    points: tuple[PointProfile, ...]
    interference: Interference | None
    itl_samples_s: tuple[float, ...]  # client-side gaps of the sweep, for the histogram


def least_squares(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float] | None:
    """(slope, intercept, r^2) of y = a*x + b, or None with fewer than 2 distinct x."""
    if len(set(xs)) < 2:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    slope = sxy / sxx
    intercept = my - slope * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - (slope * x + intercept)) ** 2 for x, y in zip(xs, ys, strict=True))
    return slope, intercept, 1 - ss_res / ss_tot if ss_tot > 0 else 1.0


def union_length_s(intervals: Sequence[tuple[float, float]]) -> float:
    """Total length covered by a set of [start, end] intervals."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None and cur_start is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None and cur_start is not None:
        total += cur_end - cur_start
    return total


def _prefill_interval(t: RequestTrace) -> tuple[float, float]:
    assert t.first_token_s is not None
    prefill = t.prefill_s() or 0.0
    return t.first_token_s - prefill, t.first_token_s


def _decode_shape(traces: Sequence[RequestTrace]) -> tuple[float, float]:
    """(mean streams decoding at once, mean cached tokens per stream), over every gap."""
    batches: list[int] = []
    contexts: list[int] = []
    for t in traces:
        for a, b in pairwise(t.token_times_s):
            mid = (a + b) / 2
            active = [u for u in traces if u.token_times_s[0] <= mid <= u.token_times_s[-1]]
            batches.append(max(1, len(active)))
            contexts.extend(u.prompt_tokens + u.tokens_by(mid) for u in active)
    if not batches:
        return 1.0, statistics.fmean(t.prompt_tokens + t.output_tokens / 2 for t in traces)
    return statistics.fmean(batches), statistics.fmean(contexts)


def _point(name: str, traces: Sequence[RequestTrace]) -> PointProfile:
    prefills = [t.prefill_s() or 0.0 for t in traces]
    if min(prefills) <= 0:
        raise UserError(
            f"probe point {name}: prefill time is zero for {sum(p <= 0 for p in prefills)} of "
            f"{len(prefills)} requests (first token at or before the send time, or server queue "
            "time >= TTFT); the target must stream tokens as they are made and report real times"
        )
    gaps = [g for t in traces for g in t.itl_s()]
    if not gaps or max(gaps) <= 0:
        raise UserError(
            f"probe point {name}: no inter-token gaps (every response arrived in one chunk); "
            "the target must stream tokens one by one (stream: true) and decode max_tokens >= 2 "
            "tokens (ignore_eos: true)"
        )
    server_itl = [t.server_itl_s for t in traces if t.server_itl_s]
    busy = union_length_s([_prefill_interval(t) for t in traces])
    batch, context = _decode_shape(traces)
    return PointProfile(
        point=name,
        concurrency=traces[0].concurrency,
        n=len(traces),
        prompt_tokens=statistics.fmean(t.prompt_tokens for t in traces),
        output_tokens=statistics.fmean(t.output_tokens for t in traces),
        ttft=stats([t.ttft_s or 0.0 for t in traces]),
        prefill=stats(prefills),
        itl=stats(gaps),
        prefill_busy_s=busy,
        prefill_overlap=sum(prefills) / busy,
        decode_batch=batch,
        decode_context_tokens=context,
        decode_step_s=statistics.fmean(server_itl) if server_itl else percentile(gaps, 50),
    )


def _prefill_window(t: RequestTrace) -> tuple[float, float]:
    """[send, first token] of an injected prompt: when its prefill could stall others."""
    return t.send_s, t.first_token_s if t.first_token_s is not None else t.send_s


def measure_interference(traces: Sequence[RequestTrace]) -> Interference | None:
    """Inter-token latency of running streams while long prompts were prefilled, vs not."""
    streams = [t for t in traces if t.role == "stream" and t.ok]
    injects = [t for t in traces if t.role == "inject" and t.ok]
    windows = [_prefill_window(t) for t in injects]
    during: list[float] = []
    outside: list[float] = []
    for t in streams:
        for (a, b), gap in zip(pairwise(t.token_times_s), t.itl_s(), strict=True):
            hit = any(a < end and b > start for start, end in windows)
            (during if hit else outside).append(gap)
    if not during or not outside:
        return None  # the streams ended before the long prompts arrived, or never overlapped
    base = percentile(outside, 50)
    if base <= 0:
        return None  # no measurable baseline to compare the spike against
    return Interference(
        baseline_itl_s=base,
        during_prefill_itl_s=statistics.fmean(during),
        max_itl_s=max(during),
        spike=statistics.fmean(during) / base,
        inject_prompt_tokens=statistics.fmean(t.prompt_tokens for t in injects),
        n_gaps_during=len(during),
    )


def profile(traces: Sequence[RequestTrace]) -> Profile:
    """Step 1: phase times per request, per point and overall; TTFT slope; interference."""
    sweep = [t for t in traces if t.role == "sweep"]
    ok = [t for t in sweep if t.ok]
    errors = [t for t in sweep if not t.ok]
    if not ok:
        first = errors[0].error if errors else "no requests were run"
        raise UserError(f"every probe request failed ({len(errors)}); first error: {first}")
    by_point: dict[str, list[RequestTrace]] = {}
    for t in ok:
        by_point.setdefault(t.point, []).append(t)
    points = tuple(_point(name, group) for name, group in by_point.items())
    single = [t for t in ok if t.concurrency == 1]
    fit = least_squares(
        [float(t.prompt_tokens) for t in single], [t.prefill_s() or 0.0 for t in single]
    )
    gaps = [g for t in ok for g in t.itl_s()]
    server = any(t.server_prefill_s is not None or t.server_itl_s is not None for t in ok)
    return Profile(
        source="server" if server else "client",
        n_requests=len(sweep),
        n_errors=len(errors),
        ttft=stats([t.ttft_s or 0.0 for t in ok]),
        prefill=stats([t.prefill_s() or 0.0 for t in ok]),
        itl=stats(gaps),
        ttft_slope_s_per_token=fit[0] if fit else None,
        ttft_intercept_s=fit[1] if fit else None,
        ttft_fit_r2=fit[2] if fit else None,
        points=points,
        interference=measure_interference(traces),
        itl_samples_s=tuple(gaps),
    )
