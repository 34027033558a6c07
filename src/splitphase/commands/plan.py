"""`splitphase plan`: size prefill and decode pools by simulation with the engine's scheduler."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from splitphase.errors import UserError


@dataclass(frozen=True)
class PlanOptions:
    """Everything `splitphase plan` takes."""

    model_config: str
    hardware: str
    workload: str
    rate: float
    slo_ttft_s: float
    slo_tpot_s: float
    out: str
    max_gpus: int = 64
    attainment: float = 0.9
    num_requests: int = 200
    price_per_hour: float | None = None
    calibration: str | None = None
    link: str = "nvlink"
    router: str = "least_loaded"
    quick: bool = False
    seed: int = 0
    progress: bool = True
    kv_cache_dtype: str = "auto"  # the pools' K/V cache ("auto": the bf16 the planner prices)
    quantization: str = "none"  # the replicas' weights (audit.weights' names; none: bf16)
    warmup_fraction: float = 0.2  # requests ahead of each simulation's measured ones


def _check(opts: PlanOptions) -> None:
    def finite_positive(name: str, v: float) -> None:
        if not (math.isfinite(v) and v > 0):
            raise UserError(f"{name} must be a number > 0, got {v:g}")

    finite_positive("--rate (requests per second)", opts.rate)
    finite_positive("--slo-ttft-s", opts.slo_ttft_s)
    finite_positive("--slo-tpot-s", opts.slo_tpot_s)
    if opts.max_gpus < 1:
        raise UserError(f"--max-gpus must be >= 1, got {opts.max_gpus}")
    if opts.num_requests < 10:
        raise UserError(f"--num-requests must be >= 10, got {opts.num_requests}")
    if not 0 < opts.attainment <= 1:
        raise UserError(f"--attainment must be in (0, 1], got {opts.attainment}")


def plan_inputs(opts: PlanOptions) -> Any:
    """Validated `PlanInputs` from the command-line options."""
    from splitphase.audit.weights import weight_format
    from splitphase.commands.audit import resolve_hardware
    from splitphase.engine.config import kv_cache_dtype_bytes
    from splitphase.hardware.specs import HardwareError, get_link
    from splitphase.model.config_sources import load_model_config
    from splitphase.sim.cost_model import Efficiency
    from splitphase.sim.metrics import SLO
    from splitphase.sim.planner import PlanInputs, SearchSpace
    from splitphase.sim.workload import parse_workload

    _check(opts)
    workload = parse_workload(opts.workload).with_rate(opts.rate)
    model = load_model_config(opts.model_config)
    hw = resolve_hardware(opts.hardware, "plan", opts.price_per_hour)
    try:
        link = get_link(opts.link)
    except HardwareError as exc:
        raise UserError(str(exc)) from exc
    eff = Efficiency.from_audit_report(opts.calibration) if opts.calibration else Efficiency()
    space = SearchSpace()
    if opts.quick:
        space = replace(space, tps=(1, 2), chunk_budgets=(512, 2048), mixed_max_num_seqs=(256,),
                        disagg_tps=((1, 1),), disagg_ratios=((1, 1), (2, 1), (1, 2)))
    # "auto": as the weights, which the planner prices in bf16 (CostModel's 2 bytes).
    kv_b = None if opts.kv_cache_dtype == "auto" else kv_cache_dtype_bytes(opts.kv_cache_dtype, 2)
    q = None if opts.quantization == "none" else opts.quantization
    weights = None if q is None else weight_format(q, "bfloat16", has_peak=hw.has_peak)
    return PlanInputs(model, hw, workload, opts.rate, SLO(opts.slo_ttft_s, opts.slo_tpot_s,
                      opts.attainment), opts.max_gpus, opts.num_requests, opts.seed, link,
                      opts.router, eff, space, kv_dtype_bytes=kv_b, weights=weights,
                      warmup_fraction=opts.warmup_fraction)


def plan(opts: PlanOptions) -> dict[str, Any]:
    """Run the search, write plan.json/.html/.md, print the summary; returns plan.json."""
    from splitphase.sim.planner import run_plan
    from splitphase.sim.report import build_plan, write_plan

    inp = plan_inputs(opts)
    progress = None
    if opts.progress:
        from tqdm import tqdm

        def progress(units: Any) -> Any:
            return tqdm(units, desc="planning (goodput per configuration)", unit="config")

    best, cands = run_plan(inp, progress)
    doc = build_plan(inp, best, cands)
    out = write_plan(opts.out, doc, cands)
    print(f"plan: {out / 'plan.html'} (also plan.json, plan.md)")
    for line in doc["summary"]:
        print(f"  - {line}")
    return doc
