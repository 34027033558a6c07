"""The audit's results as one JSON-ready document (`report.json`); see `schema.py` for its shape."""

from __future__ import annotations

import datetime as dt
from dataclasses import asdict
from typing import Any

from splitphase import __version__
from splitphase.audit import flops as fl
from splitphase.audit.probes import ProbeResult
from splitphase.audit.report.summary import summary_lines, warnings_for
from splitphase.audit.steps import AuditResult, PhaseLevel, PhaseResult, Stats
from splitphase.audit.weights import WeightFormat
from splitphase.hardware.specs import HardwareSpec
from splitphase.model.config import ModelConfig

SCHEMA_VERSION = "1.0"


def _stats(s: Stats) -> dict[str, float]:
    return {"n": s.n, "mean_s": s.mean_s, "p50_s": s.p50_s, "p90_s": s.p90_s, "p99_s": s.p99_s}


def _level(lv: PhaseLevel) -> dict[str, Any]:
    return {
        "point": lv.point,
        "concurrency": lv.concurrency,
        "batch": lv.batch,
        "prompt_tokens": lv.prompt_tokens,
        "context_tokens": lv.context_tokens,
        "flops": lv.flops,
        "bytes": lv.bytes,
        "seconds": lv.seconds,
        "intensity_flop_per_byte": lv.intensity_flop_per_byte,
        "bound": lv.bound,
        "flops_utilization": lv.flops_utilization,
        "bandwidth_utilization": lv.bandwidth_utilization,
        "achieved_flops_per_s": lv.achieved_flops_per_s,
        "tokens_per_s": lv.tokens_per_s,
        "tokens_per_s_at_full_utilization": lv.tokens_per_s_at_full,
        "gap": lv.utilization < 0.5,
    }


def _phase(res: PhaseResult, result: AuditResult) -> dict[str, Any]:
    head, neck = res.headline, result.bottleneck[res.phase]
    doc = {
        "bound": neck.bound,
        "intensity_flop_per_byte": neck.intensity_flop_per_byte,
        "ridge_flop_per_byte": neck.ridge_flop_per_byte,
        "attainable_flops_per_s": neck.attainable_flops_per_s,
        "flops_utilization": head.flops_utilization,
        "bandwidth_utilization": head.bandwidth_utilization,
        "utilization": head.utilization,
        "gap": res.gap,
        "headline_point": head.point,
        "concurrency": head.concurrency,
        "tokens_per_s": head.tokens_per_s,
        "tokens_per_s_at_full_utilization": head.tokens_per_s_at_full,
        "levels": [_level(lv) for lv in res.levels],
    }
    if res.phase == "prefill":
        doc["marginal_flops_utilization"] = res.marginal_flops_utilization
    else:
        doc["step_s"] = head.seconds
    return doc


def _profile(result: AuditResult) -> dict[str, Any]:
    prof = result.profile
    return {
        "source": prof.source,
        "n_requests": prof.n_requests,
        "n_errors": prof.n_errors,
        "ttft": _stats(prof.ttft),
        "prefill": _stats(prof.prefill),
        "itl": _stats(prof.itl),
        "ttft_slope_s_per_token": prof.ttft_slope_s_per_token,
        "ttft_intercept_s": prof.ttft_intercept_s,
        "ttft_fit_r2": prof.ttft_fit_r2,
        "interference": asdict(prof.interference) if prof.interference else None,
        "points": [
            {
                "point": p.point,
                "concurrency": p.concurrency,
                "n": p.n,
                "prompt_tokens": p.prompt_tokens,
                "output_tokens": p.output_tokens,
                "ttft": _stats(p.ttft),
                "prefill": _stats(p.prefill),
                "itl": _stats(p.itl),
                "decode_batch": p.decode_batch,
                "decode_step_s": p.decode_step_s,
            }
            for p in prof.points
        ],
    }


def _cost(result: AuditResult) -> dict[str, Any]:
    c = result.cost
    return {
        "price_usd_per_hour": c.price_usd_per_hour,
        "usd_per_million_input_tokens": c.now.usd_per_million_input_tokens,
        "usd_per_million_output_tokens": c.now.usd_per_million_output_tokens,
        "now": asdict(c.now),
        "achievable": asdict(c.achievable),
        "achievable_prefill_utilization": c.achievable_prefill_utilization,
        "achievable_decode_utilization": c.achievable_decode_utilization,
        "workload": asdict(c.workload),
        "monthly_usd": c.now.monthly_usd,
        "monthly_usd_achievable": c.achievable.monthly_usd,
        "monthly_savings_usd": c.monthly_savings_usd,
        "savings_fraction": c.savings_fraction,
        "assumptions": list(c.assumptions),
    }


def _model(cfg: ModelConfig, kv_dtype_bytes: int, weights: WeightFormat) -> dict[str, Any]:
    return {
        "name": cfg.name,
        "config": cfg.to_dict(),
        "param_count": fl.param_count(cfg),
        "active_param_count": fl.active_param_count(cfg),
        "weight_format": weights.name,  # the model's dtype, or its quantization as served
        "weight_bytes_per_param": weights.bytes_per_param,
        "weight_bytes": fl.param_count(cfg) * weights.bytes_per_param,
        "kv_dtype_bytes": kv_dtype_bytes,
        "kv_bytes_per_token": fl.kv_bytes_per_token(cfg, kv_dtype_bytes),
    }


def _hardware(hw: HardwareSpec, dtype: str) -> dict[str, Any]:
    return {
        **hw.to_dict(),
        "dtype": dtype,
        "peak_flops_per_s": hw.peak_flops_per_s(dtype),
        "ridge_flop_per_byte": hw.peak_flops_per_s(dtype) / hw.mem_bandwidth_bytes_per_s,
    }


def build_report(
    result: AuditResult,
    target: dict[str, Any],
    hw: HardwareSpec,
    cfg: ModelConfig,
    probe: ProbeResult,
) -> dict[str, Any]:
    """report.json's document: every step's figures plus a plain-language summary."""
    plan = probe.plan
    doc: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "splitphase_version": __version__,
        "generated_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "target": target,
        "hardware": _hardware(hw, result.utilization.dtype),
        "model": _model(cfg, result.utilization.kv_dtype_bytes, result.utilization.weights),
        "probe": {
            "quick": plan.quick,
            "prompt_lens": list(plan.prompt_lens),
            "concurrency_levels": list(plan.concurrency_levels),
            "output_tokens": plan.output_tokens,
            "repeats": plan.repeats,
            "workload_file": plan.workload_file,
            "n_requests": len(probe.traces),
            "duration_s": probe.duration_s,
        },
        "profile": _profile(result),
        "prefill": _phase(result.utilization.prefill, result),
        "decode": _phase(result.utilization.decode, result),
        "optimizations": [
            {**asdict(o), "speedup": o.speedup} for o in result.optimizations
        ],
        "cost": _cost(result),
    }
    doc["warnings"] = warnings_for(doc)
    doc["summary"] = summary_lines(doc)
    return doc
