"""`splitphase plan`: a small real run writes plan.json/.html/.md; bad input exits 2."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from splitphase.cli import main

BASE = ["plan", "--no-progress"]
SAMPLE = Path(__file__).parent / "mooncake_sample.jsonl"  # 40 requests


def _args(tmp_path: Path, **over: str) -> list[str]:
    opts = {"--model-config": "llama-3.1-8b", "--hardware": "h100-sxm",
            "--workload": "poisson:1,prompt=lognormal:300:0.3,output=fixed:16",
            "--rate": "30", "--slo-ttft-s": "0.5", "--slo-tpot-s": "0.05",
            "--out": str(tmp_path / "plan"), "--num-requests": "30"}
    opts.update(over)
    return BASE + [x for kv in opts.items() for x in kv]


def test_plan_writes_the_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_args(tmp_path, **{"--max-gpus": "4"}) + ["--quick"]) == 0
    doc = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert doc["best"]["gpus_at_rate"] <= 4 and doc["best"]["at_rate"]["meets_slo"]
    assert len(doc["candidates"]) >= 5
    for c in doc["candidates"]:
        assert c["goodput_per_gpu"] >= 0 and c["curve"]
    assert doc["frontier"] and (tmp_path / "plan" / "plan.html").stat().st_size > 10_000
    md = (tmp_path / "plan" / "plan.md").read_text()
    assert "Cheapest" in md and "## Goodput frontier" in md
    assert doc["warmup_fraction"] == 0.2 and "after 20% as many that warm the cluster" in md
    assert "plan.html" in capsys.readouterr().out


def test_a_plan_states_where_its_trace_replay_starts(tmp_path: Path) -> None:
    over = {"--workload": f"trace:{SAMPLE},start=10", "--num-requests": "10", "--rate": "0.5",
            "--slo-ttft-s": "5", "--slo-tpot-s": "0.1", "--max-gpus": "8"}
    assert main(_args(tmp_path, **over) + ["--quick"]) == 0
    doc = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert doc["workload"]["trace_start"] == 10 and doc["workload"]["trace_requests"] == 40
    assert doc["workload"]["name"].endswith(",start=10")
    md = (tmp_path / "plan" / "plan.md").read_text()
    assert "replaying the trace from its request 10 (of 40, counted from 0)" in md
    stated = doc["best"]["at_rate"]["prompt_tokens"]
    assert f"measured requests' prompts: mean {stated['mean']:,.0f}," in md


@pytest.mark.parametrize(("over", "message"), [
    ({"--rate": "-1"}, "--rate"),
    ({"--slo-ttft-s": "0"}, "--slo-ttft-s"),
    ({"--slo-tpot-s": "0"}, "--slo-tpot-s"),
    ({"--workload": "nosuchpreset"}, "unknown workload"),
    ({"--workload": "trace:EMPTY"}, "no requests"),
    ({"--model-config": "llama-3.1-70b", "--hardware": "l4", "--max-gpus": "1"}, "fits no"),
    ({"--warmup-fraction": "-0.1"}, "warm-up fraction"),
    ({"--workload": f"trace:{SAMPLE},start=40"}, "skips every request"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          over: dict[str, str], message: str) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    over = {k: v.replace("EMPTY", str(empty)) for k, v in over.items()}
    assert main(_args(tmp_path, **over)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("splitphase: error:") and message in err and "\n" not in err


def test_an_fp8_kv_cache_gives_every_replica_twice_the_blocks(tmp_path: Path) -> None:
    from splitphase.commands.plan import PlanOptions, plan_inputs
    from splitphase.sim.planner import candidate_units

    def blocks(kv: str) -> list[int]:
        opts = PlanOptions("llama-3.1-8b", "h100-sxm", "poisson:1", 1.0, 0.5, 0.05,
                           str(tmp_path), kv_cache_dtype=kv)
        inp = plan_inputs(opts)
        assert inp.kv_dtype_bytes == {"auto": None, "fp8": 1}[kv]
        return [p.scheduler.num_blocks for u in candidate_units(inp, 512) for p in u.pools()]

    for bf16, fp8 in zip(blocks("auto"), blocks("fp8"), strict=True):
        assert fp8 in (2 * bf16, 2 * bf16 + 1)
    assert main(_args(tmp_path, **{"--max-gpus": "2", "--kv-cache-dtype": "fp8"})
                + ["--quick"]) == 0
    doc = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert doc["kv_dtype_bytes"] == 1
    assert "K/V cache 1 byte/element" in (tmp_path / "plan" / "plan.html").read_text()


def test_plan_with_fp8_weights(tmp_path: Path) -> None:
    assert main(_args(tmp_path, **{"--max-gpus": "2", "--quantization": "fp8"}) + ["--quick"]) == 0
    doc = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert doc["weights"] == {"format": "fp8", "bytes_per_param": 1.0,
                              "compute_dtype": "float8"}
    assert "weights fp8 (matmuls in float8)" in (tmp_path / "plan" / "plan.html").read_text()


def test_int8_w8a8_replicas_multiply_at_the_int8_peak(tmp_path: Path) -> None:
    from splitphase.commands.plan import PlanOptions, plan_inputs
    from splitphase.sim.cost_model import CostModel

    opts = PlanOptions("llama-3.1-8b", "a100", "poisson:1", 1.0, 0.5, 0.05, str(tmp_path),
                       quantization="w8a8_int8")
    inp = plan_inputs(opts)
    assert inp.weight_kwargs() == {"dtype": "int8", "weight_bytes_per_param": 1.0}
    int8 = CostModel(inp.model, inp.hardware, **inp.weight_kwargs())
    bf16 = CostModel(inp.model, inp.hardware)
    long_prefill = [(2048, 0)] * 4  # compute-bound: twice the peak, about half the time
    assert int8.step_time(long_prefill, []).total_s < 0.6 * bf16.step_time(long_prefill, []).total_s


def test_the_plan_page_fits_a_laptop_screen(
    tmp_path: Path, render_page: Callable[[Path], dict[str, Any]]
) -> None:
    # Every column, costs included, is visible without scrolling sideways at 1200 px.
    assert main(_args(tmp_path, **{"--max-gpus": "4"}) + ["--quick"]) == 0
    page = render_page(tmp_path / "plan" / "plan.html")
    assert page["images"] and all(w > 0 for w in page["images"]), page
    assert len(page["tables"]) == 2
    assert all(scroll <= client for scroll, client in page["tables"]), page["tables"]
