"""The planner reproduces the published direction: disaggregation for long prompts under tight
TTFT and TPOT SLOs (DistServe), colocated chunked prefill for short prompts with loose TTFT."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from splitphase.errors import UserError
from splitphase.hardware.specs import get_hardware
from splitphase.model.config import ModelConfig
from splitphase.sim.metrics import SLO
from splitphase.sim.planner import (
    Candidate,
    PlanInputs,
    SearchSpace,
    candidate_units,
    run_at,
    run_plan,
)
from splitphase.sim.report import build_plan
from splitphase.sim.workload import parse_workload

SPACE = SearchSpace(tps=(1,), chunk_budgets=(128, 256, 512, 2048), mixed_max_num_seqs=(256,),
                    disagg_tps=((1, 1),), disagg_ratios=((1, 1), (2, 1), (1, 2)))


def _plan(workload: str, rate: float, ttft_s: float, tpot_s: float, n: int
          ) -> tuple[PlanInputs, Candidate | None, list[Candidate]]:
    inp = PlanInputs(ModelConfig.from_name("llama-3.1-8b"), get_hardware("h100-sxm"),
                     parse_workload(workload), rate, SLO(ttft_s, tpot_s), max_gpus=16,
                     num_requests=n, space=SPACE)
    best, cands = run_plan(inp)
    return inp, best, cands


def _best(cands: list[Candidate], disagg: bool) -> Candidate:
    return max((c for c in cands if (c.unit.policy == "disaggregated") == disagg),
               key=lambda c: c.goodput_per_gpu)


def test_long_prompts_tight_slos_prefer_disaggregation() -> None:
    inp, best, cands = _plan("poisson:1,prompt=lognormal:6000:0.1,output=fixed:32", 4.0,
                             0.6, 0.012, 40)
    dis, colo = _best(cands, True), _best(cands, False)
    ratio = dis.goodput_per_gpu / colo.goodput_per_gpu
    print(f"long prompts: disaggregated {dis.goodput_per_gpu:.3g} vs colocated "
          f"{colo.goodput_per_gpu:.3g} req/s/GPU ({ratio:.2f}x)")
    assert ratio > 1.2
    assert best is not None and best.unit.policy == "disaggregated"
    assert best.verified is not None and best.verified["meets_slo"]
    doc = build_plan(inp, best, cands)
    assert doc["disaggregated_over_colocated_goodput"] == ratio
    # The lowest probe that missed the SLOs, or the capacity, bounds the goodput from above.
    assert dis.goodput_per_gpu <= dis.goodput_per_gpu_bounds()[1] <= dis.capacity_rate_per_s
    assert colo.goodput_per_gpu_bounds()[1] < dis.goodput_per_gpu  # apart: a winner
    assert any("disaggregated wins" in line for line in doc["summary"])
    assert len(doc["candidates"]) == len(cands) == 8


def test_short_prompts_loose_ttft_prefer_colocated_chunked() -> None:
    _, best, cands = _plan("poisson:1,prompt=lognormal:100:0.3,output=fixed:64", 20.0,
                           1.0, 0.03, 100)
    dis, colo = _best(cands, True), _best(cands, False)
    ratio = colo.goodput_per_gpu / dis.goodput_per_gpu
    print(f"short prompts: colocated {colo.unit.label()} {colo.goodput_per_gpu:.3g} vs "
          f"disaggregated {dis.goodput_per_gpu:.3g} req/s/GPU ({ratio:.2f}x)")
    assert ratio > 1.1
    chunked = max((c for c in cands if c.unit.policy == "chunked"),
                  key=lambda c: c.goodput_per_gpu)
    assert chunked.goodput_per_gpu > 1.1 * dis.goodput_per_gpu
    # mixed and chunked with a large budget schedule short prompts alike; either may lead.
    assert best is not None and best.unit.policy in ("chunked", "mixed")
    # 20 req/s needs one GPU of the winner: its goodput per GPU is far above that.
    assert best.gpus_needed == 1 and best.verified is not None and best.verified["meets_slo"]


def test_goodput_is_zero_when_the_slo_cannot_be_met() -> None:
    # A 6000-token prefill takes far more than 1 ms on any configuration.
    _, best, cands = _plan("poisson:1,prompt=fixed:6000,output=fixed:8", 1.0, 0.001, 0.05, 20)
    assert best is None
    assert all(c.goodput_rate_per_s == 0 for c in cands)


def test_goodputs_within_the_search_resolution_are_a_tie() -> None:
    inp, best, cands = _plan("poisson:1,prompt=lognormal:6000:0.1,output=fixed:32", 4.0,
                             0.6, 0.012, 40)
    dis, colo = _best(cands, True), _best(cands, False)
    # The colocated search as if it had found the disaggregated goodput per GPU, give or take
    # less than the step between its last passing and failing probes.
    found, ceiling = dis.goodput_per_gpu_bounds()
    colo.goodput_rate_per_s = 0.99 * found * colo.unit_gpus
    colo.failing_rate_per_s = 1.01 * ceiling * colo.unit_gpus
    lines = build_plan(inp, best, cands)["summary"]
    assert any("a tie within the goodput search's resolution" in line for line in lines)
    assert not any(" wins" in line for line in lines)


def test_each_probe_measures_its_requests_after_a_warm_up() -> None:
    inp = PlanInputs(ModelConfig.from_name("llama-3.1-8b"), get_hardware("h100-sxm"),
                     parse_workload("poisson:1,prompt=fixed:2000,output=fixed:64"), 1.0,
                     SLO(0.3, 0.05), num_requests=40, space=SPACE)
    assert inp.warmup_fraction == 0.2
    unit = candidate_units(inp, 2064)[0]
    res, reqs = run_at(inp, unit, 40.0, 40)
    assert len(reqs) == 48 and len(res.records) == 48
    assert sorted(r.index for r in res.measured_records) == list(range(8, 48))
    cold, cold_reqs = run_at(replace(inp, warmup_fraction=0.0), unit, 40.0, 40)
    assert cold_reqs == reqs[:40] and cold.measured_records == cold.records
    with pytest.raises(UserError, match="warm-up fraction"):
        replace(inp, warmup_fraction=1.5)


def test_a_trace_too_short_for_a_probe_warms_the_same_share_of_it() -> None:
    sample = Path(__file__).parent / "mooncake_sample.jsonl"  # 40 requests
    inp = PlanInputs(ModelConfig.from_name("llama-3.1-8b"), get_hardware("h100-sxm"),
                     parse_workload(f"trace:{sample},start=16"), 1.0, SLO(5.0, 0.1),
                     num_requests=20, space=SPACE, length_cap=32768)
    unit = candidate_units(inp, 32768)[0]
    res, reqs = run_at(inp, unit, 1.0, 20)  # 20 + 4 asked of the 24 there are
    assert len(reqs) == 24 and len(res.measured_records) == 20
    res, reqs = run_at(inp, unit, 1.0, 100)  # a probe asking for more gets 24, 4 warming
    assert len(reqs) == 24 and len(res.measured_records) == 20
    with pytest.raises(UserError, match="holds 24 requests from request 16 on"):
        replace(inp, num_requests=21)  # 21 + 5
