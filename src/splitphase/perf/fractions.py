"""Raw timings into fractions of the measured peaks, and rounds merged into one best.

bench/phase_limits.py times each figure once per round and keeps the best; this is where its
seconds become tok/s, bytes/s and FLOP/s, and those become fractions of the triad bandwidth
and the matmul peak measured in the same run.
"""

from __future__ import annotations

from typing import Any

from splitphase.model.config import ModelConfig
from splitphase.perf.peaks import prefill_gemm_ceiling


def derive_fractions(
    raw: dict[str, Any], peaks: dict[str, float], dtype: str, cfg: ModelConfig
) -> dict[str, Any]:
    """Adds tok/s, implied bandwidth and FLOP/s, and their fractions of the measured peaks;
    a prefill also gets the ceiling its own GEMM shapes allow (`prefill_gemm_ceiling`)."""
    triad = peaks["triad_bytes_per_s"]
    flops_peak = peaks[f"matmul_model_shapes_flops_per_s_{dtype}"]
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for key, v in out.items():
        if key.startswith("decode_b"):
            v["tok_per_s"] = v["batch"] / v["step_s"]
            v["bandwidth_bytes_per_s"] = v["bytes_per_step"] / v["step_s"]
            v["bw_fraction"] = v["bandwidth_bytes_per_s"] / triad
        elif key.startswith("prefill_"):
            v["flops_per_s"] = v["flops"] / v["s"]
            v["flops_fraction"] = v["flops_per_s"] / flops_peak
            if not cfg.is_moe:
                v["gemm_ceiling_fraction"] = prefill_gemm_ceiling(cfg, peaks, dtype, v["tokens"])
    out["decode_overhead_fraction_b1"] = out["decode_overhead_s_b1"] / out["decode_b1"]["step_s"]
    for key in [k for k in out if k.startswith("interleaved_prefill_")]:
        p = out[key]
        p["flops_fraction"] = p["prefill_flops"] / p["prefill_s"] * p["gemm_s"] / p["gemm_flops"]
    _interleaved_fractions(out["interleaved_b1_triad"], out["decode_b1"]["bytes_per_step"])
    return out


def _interleaved_fractions(w: dict[str, Any], bytes_per_step: float) -> None:
    """The batch-1 step against the triad and read passes it alternated with."""
    w["triad_bytes_per_s"] = w["triad_bytes_per_pass"] / w["triad_pass_s"]
    w["read_bytes_per_s"] = w["read_bytes_per_pass"] / w["read_pass_s"]
    w["bw_fraction"] = bytes_per_step / w["step_s"] / w["triad_bytes_per_s"]
    w["read_fraction"] = bytes_per_step / w["step_s"] / w["read_bytes_per_s"]


def best_of_rounds(a: Any, b: Any, larger: bool = False) -> Any:
    """Merge two rounds: the best time (or rate, if `larger`) per figure; a stated reason
    (a string) gives way to a measurement."""
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: best_of_rounds(a[k], b[k], larger) if k in a and k in b
                else a.get(k, b.get(k)) for k in {**a, **b}}
    if isinstance(a, str) or a is None:
        return b
    if isinstance(b, str) or b is None:
        return a
    if isinstance(a, float) and isinstance(b, float):
        return max(a, b) if larger else min(a, b)
    return a  # sizes, counts: equal across rounds
