"""Step 4: phase-specific optimizations, each with its evidence.

Measured where the probe allows (the black-box prefill-interference probe, and for our own
engine the same probe under each batching policy); projected by the
cost model otherwise: audit.flops on a changed config, timed on the roofline at the efficiency
the target measurably reaches (measured time = roofline time / efficiency), so a projection
never assumes better kernels than the target already has.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from splitphase.audit import flops as fl
from splitphase.audit import roofline as rl
from splitphase.audit.steps.profile import Profile
from splitphase.audit.steps.utilization import PhaseLevel, Utilization
from splitphase.hardware.specs import HardwareSpec
from splitphase.model.config import ModelConfig

if TYPE_CHECKING:
    from splitphase.audit.policies import PolicyResult

SPIKE_THRESHOLD = 1.5  # p50 ITL during a long prefill over p50 otherwise: "prefill stalls decode"
MAX_DECODE_BATCH = 256
MEMORY_HEADROOM = 0.9  # share of device memory weights + KV may fill (activations, fragments)


@dataclass(frozen=True)
class ServingLimits:
    """What the target is configured to hold, where it says (None: not stated)."""

    kv_pool_tokens: int | None = None  # tokens its K/V pool holds
    max_num_seqs: int | None = None  # sequences it runs at once


NOT_STATED = ServingLimits()


@dataclass(frozen=True)
class Optimization:
    """One recommendation: what changes, its evidence, and the metric before and after."""

    name: str
    phase: str
    evidence: str  # "measured" | "projected"
    applicable: bool
    metric: str
    unit: str
    before: float | None
    after: float | None
    detail: str

    @property
    def speedup(self) -> float | None:
        """before / after for times (lower is better), after / before for rates."""
        if self.before is None or self.after is None or self.before <= 0 or self.after <= 0:
            return None
        return self.before / self.after if self.unit == "s" else self.after / self.before


def _projected_s(cost: fl.PhaseCost, hw: HardwareSpec, dtype: str, efficiency: float) -> float:
    return rl.roofline_time_s(cost.flops, cost.bytes, hw, dtype) / efficiency


def _ctx(lv: PhaseLevel) -> list[int]:
    return [max(0, round(lv.context_tokens))] * max(1, round(lv.batch))


def _decode(cfg: ModelConfig, util: Utilization, context_lens: list[int]) -> fl.PhaseCost:
    """A decode step's cost with the audited target's weights and K/V cache width."""
    return fl.decode_cost(cfg, context_lens, util.weights.bytes_per_param,
                          kv_dtype_bytes=util.kv_dtype_bytes)


def _stall_cause(stalls: bool, current_policy: str | None) -> str:
    if not stalls:
        return "prefill is already kept off the decode path"
    if current_policy == "disaggregated":  # stated by the target: no shared batches to split
        return ("prefill already runs on a worker of its own, so what remains is contention for "
                "hardware both workers share (cores, memory bandwidth): separate devices "
                "remove it")
    return ("prefill is batched with decode; chunked prefill (Sarathi-Serve) or disaggregated "
            "prefill and decode (DistServe, Splitwise) keeps decode near its baseline")


def interference(prof: Profile, util: Utilization, current_policy: str | None = None
                 ) -> Optimization:
    """Does a long prefill stall running streams? Measured when the probe ran, else projected.
    `current_policy`: the target's batching policy where it states it."""
    inter = prof.interference
    step_s = util.decode.headline.seconds
    if inter is not None:
        stalls = inter.spike >= SPIKE_THRESHOLD
        detail = (
            f"while {inter.inject_prompt_tokens:.0f}-token prompts were prefilled, running "
            f"streams' inter-token latency went from {inter.baseline_itl_s * 1e3:.1f} ms to "
            f"{inter.during_prefill_itl_s * 1e3:.1f} ms (mean over p50, {inter.spike:.2f}x; worst "
            f"{inter.max_itl_s * 1e3:.1f} ms): " + _stall_cause(stalls, current_policy)
        )
        return Optimization(
            "isolate prefill from decode", "decode", "measured", stalls, "mean inter-token "
            "latency during a long prefill", "s", inter.during_prefill_itl_s,
            inter.baseline_itl_s if stalls else inter.during_prefill_itl_s, detail,
        )
    longest = max((lv for lv in util.prefill.levels if lv.concurrency == 1),
                  key=lambda lv: lv.prompt_tokens, default=util.prefill.headline)
    prefill_s = longest.seconds / max(1.0, longest.tokens / max(longest.prompt_tokens, 1))
    stalled = prefill_s + step_s  # a mixed step runs the whole prompt, then the decode tokens
    detail = (
        f"projected from measured phase times (this target runs requests batch by batch, so it "
        f"was not measured): under mixed scheduling a {longest.prompt_tokens:.0f}-token prompt "
        f"stalls every running stream for one step of {stalled * 1e3:.1f} ms instead of "
        f"{step_s * 1e3:.1f} ms ({stalled / step_s:.1f}x); chunked prefill bounds it to one chunk"
    )
    return Optimization("isolate prefill from decode", "decode", "projected", True,
                        "worst inter-token latency while a long prompt is admitted", "s",
                        stalled, step_s, detail)


def larger_decode_batch(
    util: Utilization, cfg: ModelConfig, hw: HardwareSpec,
    limits: ServingLimits = NOT_STATED,
) -> Optimization:
    """Decode tokens/s at the largest batch that fits in memory, up to the ridge point; where
    the target's configured pool or sequence limit holds fewer streams, the detail says so."""
    lv = util.decode.headline
    context = max(1, round(lv.context_tokens))
    weights_b = fl.param_count(cfg) * util.weights.bytes_per_param
    kv_per_seq_b = fl.kv_bytes_per_token(cfg, util.kv_dtype_bytes) * (context + 1)
    fits = int((hw.mem_capacity_bytes * MEMORY_HEADROOM - weights_b) // kv_per_seq_b)
    batch = max(1, round(lv.batch))
    ridge, target = util.decode.ridge_flop_per_byte, batch
    while target < min(fits, MAX_DECODE_BATCH):
        target *= 2  # powers of two, stopping once the step turns compute-bound
        if _decode(cfg, util, [context] * target).intensity >= ridge:
            break
    target = min(target, max(fits, 1), MAX_DECODE_BATCH)
    cost = _decode(cfg, util, [context] * target)
    after = target / _projected_s(cost, hw, util.dtype, lv.utilization)
    detail = (
        f"batch {batch} -> {target} streams at {context} cached tokens each (memory holds "
        f"{max(fits, 0)}): weights are read once per step for every stream, so tokens/s grow "
        f"almost linearly while decode stays memory-bound"
    ) + _limits_note(limits, context, target)
    return Optimization("larger decode batch", "decode", "projected", target > batch,
                        "decode tokens/s (all streams)", "tokens/s", lv.tokens_per_s, after, detail)


def _limits_note(limits: ServingLimits, context: int, target: int) -> str:
    """What the target's configuration holds, where that stops the batch short of `target`."""
    note = ""
    pool = limits.kv_pool_tokens
    if pool is not None and pool // (context + 1) < target:
        note += (
            f"; the target's K/V pool holds {pool:,} tokens, about {pool // (context + 1)} such "
            "streams: past that it needs a larger pool (vLLM --gpu-memory-utilization or "
            "--kv-cache-memory-bytes, SGLang --mem-fraction-static, splitphase serve "
            "--kv-cache-bytes)"
        )
    seqs = limits.max_num_seqs
    if seqs is not None and seqs < target:
        note += (
            f"; it runs at most {seqs} sequences at once: past that raise --max-num-seqs "
            "(SGLang --max-running-requests)"
        )
    return note


def moe_decode_top_k(util: Utilization, cfg: ModelConfig, hw: HardwareSpec) -> Optimization:
    """Per-phase MoE fan-out: decode with half the experts per token, prefill unchanged."""
    lv = util.decode.headline
    if not cfg.is_moe:
        return Optimization("per-phase MoE top-k", "decode", "projected", False,
                            "decode step time", "s", None, None, "dense model: no experts to route")
    k = max(1, cfg.top_k // 2)
    before = _projected_s(_decode(cfg, util, _ctx(lv)), hw, util.dtype, lv.utilization)
    after = _projected_s(_decode(cfg.with_(top_k=k), util, _ctx(lv)), hw, util.dtype,
                         lv.utilization)
    detail = (
        f"top-{cfg.top_k} -> top-{k} in decode only: fewer distinct experts read per step; "
        "prefill keeps its fan-out (quality cost to validate; Dual-Flow MoE results suggest "
        "spending experts where they pay)"
    )
    return Optimization("per-phase MoE top-k", "decode", "projected", True, "decode step time",
                        "s", before, after, detail)


def dual_flow_decode(util: Utilization, cfg: ModelConfig, hw: HardwareSpec) -> Optimization:
    """A Dual-Flow auxiliary decode flow spends idle compute: extra FLOPs, no extra KV bytes."""
    lv = util.decode.headline
    if cfg.is_dual_flow:
        return Optimization("Dual-Flow decode flow", "decode", "projected", False,
                            "decode step time", "s", None, None, "already a Dual-Flow model")
    twin = cfg.with_(arch="dual_flow")
    base = _decode(cfg, util, _ctx(lv))
    dual = _decode(twin, util, _ctx(lv))
    before = _projected_s(base, hw, util.dtype, lv.utilization)
    after = _projected_s(dual, hw, util.dtype, lv.utilization)
    idle = 1 - lv.flops_utilization
    detail = (
        f"decode uses {lv.flops_utilization:.1%} of compute; an auxiliary flow adds "
        f"{dual.flops / base.flops - 1:+.0%} FLOPs and {dual.bytes / base.bytes - 1:+.1%} bytes "
        f"per step (no KV) for a step time change of {after / before - 1:+.1%}: {idle:.0%} of "
        "compute is idle, so the extra quality per token is almost free (needs a Dual-Flow model)"
    )
    return Optimization("Dual-Flow decode flow", "decode", "projected", True, "decode step time",
                        "s", before, after, detail)


def shallower_prefill(util: Utilization, cfg: ModelConfig, hw: HardwareSpec) -> Optimization:
    """Prefill with half the layers (SwiftKV / SPEED style prompt KV from fewer layers)."""
    lv = util.prefill.headline
    n = max(1, round(lv.prompt_tokens))
    layers = max(1, cfg.n_layers // 2)
    kv_b, w_b = util.kv_dtype_bytes, util.weights.bytes_per_param
    full = fl.prefill_cost(cfg, n, w_b, kv_dtype_bytes=kv_b)
    lean = fl.prefill_cost(cfg.with_(n_layers=layers), n, w_b, kv_dtype_bytes=kv_b)
    before = _projected_s(full, hw, util.dtype, lv.utilization)
    after = _projected_s(lean, hw, util.dtype, lv.utilization)
    detail = (
        f"prefill a {n}-token prompt through {layers} of {cfg.n_layers} layers: "
        f"{lean.flops / full.flops:.0%} of the FLOPs; needs a model trained for it (SwiftKV, "
        "SPEED, or a smaller prefill model that writes the decode model's KV)"
    )
    return Optimization("shallower prefill model", "prefill", "projected", cfg.n_layers > 1,
                        "prefill time per prompt", "s", before, after, detail)


def quantized_weights(util: Utilization, cfg: ModelConfig, hw: HardwareSpec) -> Optimization:
    """Weights at 1 byte per parameter: fewer bytes per decode step (KV unchanged)."""
    lv = util.decode.headline
    base = _decode(cfg, util, _ctx(lv))
    q_bytes = fl.decode_bytes(cfg, _ctx(lv), dtype_bytes=1, kv_dtype_bytes=util.kv_dtype_bytes)
    before = _projected_s(base, hw, util.dtype, lv.utilization)
    after = _projected_s(fl.PhaseCost(base.flops, q_bytes), hw, util.dtype, lv.utilization)
    now = util.weights.bytes_per_param
    detail = (
        f"{now:g} -> 1 byte per weight (int8/fp8 weight-only): "
        f"{q_bytes / base.bytes:.0%} of the bytes per decode step"
    )
    if now <= 1:
        detail = (f"weights are already {util.weights.name} ({now:.3g} "
                  f"byte{'' if now == 1 else 's'} per weight)")
    return Optimization("weight quantization", "decode", "projected", now > 1,
                        "decode step time", "s", before, after, detail)


def narrower_kv_cache(util: Utilization, cfg: ModelConfig, hw: HardwareSpec) -> Optimization:
    """K/V stored at half the target's cache width (fp32 -> bf16, bf16 -> fp8): fewer bytes per
    decode step, the more so the longer the contexts and the larger the batch."""
    lv = util.decode.headline
    now = util.kv_dtype_bytes
    kv_bytes = max(1, now // 2)
    base = _decode(cfg, util, _ctx(lv))
    narrow = fl.decode_bytes(cfg, _ctx(lv), util.weights.bytes_per_param,
                             kv_dtype_bytes=kv_bytes)
    before = _projected_s(base, hw, util.dtype, lv.utilization)
    after = _projected_s(fl.PhaseCost(base.flops, narrow), hw, util.dtype, lv.utilization)
    name = {2: "bf16", 1: "fp8"}.get(kv_bytes, f"{kv_bytes}-byte")
    detail = (
        f"K/V cache in {name} ({now} -> {kv_bytes} bytes; vLLM's and our engine's "
        f"kv_cache_dtype): {narrow / base.bytes:.0%} of the bytes per decode step at "
        f"{lv.context_tokens:.0f} tokens of context, and twice the tokens in the same memory"
    )
    if now == 1:
        detail = "the K/V cache already stores 1 byte per element (fp8)"
    return Optimization("narrower K/V cache", "decode", "projected", now > 1,
                        "decode step time", "s", before, after, detail)


def batching_policy(results: Sequence[PolicyResult], current: str | None) -> Optimization:
    """Measured: the same interference probe under each batching policy of our engine."""
    from splitphase.audit.policies import describe, measured

    ok = measured(results)
    itl = {r.policy: r.during_prefill_itl_s or 0.0 for r in ok}
    best = min(ok, key=lambda r: itl[r.policy])
    now = next((r for r in ok if r.policy == current), None)
    # "Before" is what the audited engine runs, so the headline gain is the one a user would
    # get by switching; only when that policy is unknown (or unmeasured) the measured range.
    before = now if now is not None else max(ok, key=lambda r: itl[r.policy])
    runs = "" if current is None else f"; the audited engine runs {current}"
    detail = (
        f"measured on this engine, same weights and probe: {describe(results)}. Best: "
        f"{best.policy}, against {before.policy}{runs}"
    )
    return Optimization(
        f"batching policy: {best.policy}", "decode", "measured", before.policy != best.policy,
        "mean inter-token latency during a long prefill", "s", itl[before.policy],
        itl[best.policy], detail,
    )


def optimizations(
    prof: Profile, util: Utilization, cfg: ModelConfig, hw: HardwareSpec,
    policy_results: Sequence[PolicyResult] = (), current_policy: str | None = None,
    limits: ServingLimits = NOT_STATED,
) -> list[Optimization]:
    """Step 4: every optimization, most promising (largest speedup) first."""
    any_measured = any(r.measured for r in policy_results)
    by_policy = [batching_policy(policy_results, current_policy)] if any_measured else []
    inter = interference(prof, util, current_policy)
    if by_policy:
        # Isolation's "after" is the no-prefill baseline, an ideal; where every policy of the
        # engine was measured, what isolating achieves here is that row's, not this one's.
        inter = replace(inter, applicable=False, detail=inter.detail + "; what each batching "
                        "policy achieves on this engine is measured in its own row")
    found = [
        *by_policy,
        inter,
        larger_decode_batch(util, cfg, hw, limits),
        moe_decode_top_k(util, cfg, hw),
        dual_flow_decode(util, cfg, hw),
        shallower_prefill(util, cfg, hw),
        quantized_weights(util, cfg, hw),
        narrower_kv_cache(util, cfg, hw),
    ]
    return sorted(found, key=lambda o: (not o.applicable, -(o.speedup or 0.0)))
