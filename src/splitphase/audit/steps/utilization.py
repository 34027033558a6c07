"""Steps 2 and 3: each phase's bottleneck on the roofline, and how much of it is used.

Prefill FLOP utilization = analytical prefill FLOPs / measured prefill time / peak FLOP/s.
Decode bandwidth utilization = analytical bytes per step (weights once + KV of the batch's
contexts, at the K/V cache's width) / measured step time / peak bandwidth. Both per probe
point; the headline is the point where the phase ran fastest. Peaks come only from the
`HardwareSpec`.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitphase.audit import flops as fl
from splitphase.audit import roofline as rl
from splitphase.audit.steps.profile import PointProfile, Profile
from splitphase.audit.weights import WeightFormat, weight_format
from splitphase.hardware.specs import HardwareSpec
from splitphase.model.config import ModelConfig

GAP_THRESHOLD = 0.5  # under half of the binding resource is a gap worth a software fix


@dataclass(frozen=True)
class PhaseLevel:
    """One phase at one probe point: work, time, roofline position and utilization."""

    point: str
    concurrency: int
    batch: float  # requests sharing the hardware at once
    prompt_tokens: float
    context_tokens: float
    flops: float
    bytes: float
    seconds: float
    tokens: float
    intensity_flop_per_byte: float
    bound: str
    flops_utilization: float
    bandwidth_utilization: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def achieved_flops_per_s(self) -> float:
        return self.flops / self.seconds

    @property
    def utilization(self) -> float:
        """Utilization of the binding resource (the roofline's lower bound over the time)."""
        return max(self.flops_utilization, self.bandwidth_utilization)

    @property
    def tokens_per_s_at_full(self) -> float:
        """Tokens/s if the binding resource ran at its peak (the roofline time)."""
        return self.tokens_per_s / self.utilization


@dataclass(frozen=True)
class PhaseResult:
    """A phase's headline level (fastest point), every level, and the gap flag."""

    phase: str
    headline: PhaseLevel
    levels: tuple[PhaseLevel, ...]
    ridge_flop_per_byte: float
    marginal_flops_utilization: float | None = None  # prefill: from the TTFT slope

    @property
    def gap(self) -> bool:
        return self.headline.utilization < GAP_THRESHOLD


@dataclass(frozen=True)
class Utilization:
    """Steps 2 and 3 for both phases."""

    prefill: PhaseResult
    decode: PhaseResult
    dtype: str  # the matmuls' dtype, whose peak FLOP/s applies (an FP8 model's: float8)
    kv_dtype_bytes: int  # bytes per cached K or V element (a bf16 or fp8 cache is narrower)
    weights: WeightFormat  # bytes per weight as served (a quantized model's are fewer)


def _weights(cfg: ModelConfig, weights: WeightFormat | None) -> WeightFormat:
    return weights if weights is not None else weight_format(None, cfg.dtype)


def _level(
    p: PointProfile, cost: fl.PhaseCost, batches: float, seconds: float, tokens: float,
    hw: HardwareSpec, dtype: str, batch: float,
) -> PhaseLevel:
    flops, nbytes = cost.flops * batches, cost.bytes * batches
    return PhaseLevel(
        point=p.point,
        concurrency=p.concurrency,
        batch=batch,
        prompt_tokens=p.prompt_tokens,
        context_tokens=p.decode_context_tokens,
        flops=flops,
        bytes=nbytes,
        seconds=seconds,
        tokens=tokens,
        intensity_flop_per_byte=cost.intensity,
        bound=rl.classify(cost.intensity, hw, dtype),
        flops_utilization=rl.flops_utilization(flops, seconds, hw.peak_flops_per_s(dtype)),
        bandwidth_utilization=rl.bandwidth_utilization(
            nbytes, seconds, hw.mem_bandwidth_bytes_per_s
        ),
    )


def prefill_level(
    p: PointProfile, cfg: ModelConfig, hw: HardwareSpec, kv_dtype_bytes: int | None = None,
    weights: WeightFormat | None = None,
) -> PhaseLevel:
    """Prefill of a point: all its prompts' FLOPs over the union of their prefill intervals."""
    w = _weights(cfg, weights)
    n = max(1, round(p.prompt_tokens))
    together = max(1, round(p.prefill_overlap))
    step = fl.step_cost(cfg, [(n, 0)] * together, [], w.bytes_per_param,
                        kv_dtype_bytes=kv_dtype_bytes or cfg.dtype_bytes)
    # Weights are read once per batch of `together` prompts; the point ran n/together batches.
    return _level(
        p, step.total, p.n / together, p.prefill_busy_s, p.n * p.prompt_tokens, hw,
        w.compute_dtype, together,
    )


def decode_level(
    p: PointProfile, cfg: ModelConfig, hw: HardwareSpec, kv_dtype_bytes: int | None = None,
    weights: WeightFormat | None = None,
) -> PhaseLevel:
    """One decode step of a point: its measured batch at its mean context, over the step time."""
    w = _weights(cfg, weights)
    batch = max(1, round(p.decode_batch))
    context = max(0, round(p.decode_context_tokens))
    cost = fl.decode_cost(cfg, [context] * batch, w.bytes_per_param,
                          kv_dtype_bytes=kv_dtype_bytes or cfg.dtype_bytes)
    return _level(p, cost, 1, p.decode_step_s, batch, hw, w.compute_dtype, batch)


def _marginal_prefill(prof: Profile, cfg: ModelConfig, hw: HardwareSpec, dtype: str
                      ) -> float | None:
    """FLOPs per extra prompt token over seconds per extra prompt token (the TTFT slope)."""
    slope = prof.ttft_slope_s_per_token
    lens = sorted({round(p.prompt_tokens) for p in prof.points if p.concurrency == 1})
    if slope is None or slope <= 0 or len(lens) < 2:
        return None
    dflops = (fl.prefill_flops(cfg, lens[-1]) - fl.prefill_flops(cfg, lens[0])) / (
        lens[-1] - lens[0]
    )
    return dflops / slope / hw.peak_flops_per_s(dtype)


def utilization(
    prof: Profile, cfg: ModelConfig, hw: HardwareSpec, kv_dtype_bytes: int | None = None,
    weights: WeightFormat | None = None,
) -> Utilization:
    """Step 3: utilization per phase and point; the headline is each phase's fastest point.
    `kv_dtype_bytes`: the target's K/V cache width when narrower than the model's; `weights`:
    how it stores its weights (None: unquantized, in the model's dtype)."""
    w = _weights(cfg, weights)
    dtype = w.compute_dtype
    ridge = rl.ridge_point(hw, dtype)
    kv_b = cfg.dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes
    pre = tuple(prefill_level(p, cfg, hw, kv_b, w) for p in prof.points)
    dec = tuple(decode_level(p, cfg, hw, kv_b, w) for p in prof.points)
    return Utilization(
        prefill=PhaseResult(
            "prefill", max(pre, key=lambda lv: lv.achieved_flops_per_s), pre, ridge,
            _marginal_prefill(prof, cfg, hw, dtype),
        ),
        decode=PhaseResult("decode", max(dec, key=lambda lv: lv.tokens_per_s), dec, ridge),
        dtype=dtype,
        kv_dtype_bytes=kv_b,
        weights=w,
    )


@dataclass(frozen=True)
class Bottleneck:
    """Step 2 for one phase: where its headline work sits against the ridge point."""

    phase: str
    intensity_flop_per_byte: float
    ridge_flop_per_byte: float
    bound: str
    attainable_flops_per_s: float


def bottleneck(util: Utilization, hw: HardwareSpec) -> dict[str, Bottleneck]:
    """Step 2: compute- or memory-bound per phase, at step 3's headline level's shape."""
    out = {}
    for res in (util.prefill, util.decode):
        ai = res.headline.intensity_flop_per_byte
        out[res.phase] = Bottleneck(
            res.phase, ai, res.ridge_flop_per_byte, rl.classify(ai, hw, util.dtype),
            rl.attainable_flops_per_s(ai, hw, util.dtype),
        )
    return out
