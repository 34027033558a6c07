"""report.json against its schema, the HTML's plots, and the page in headless Chromium."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from splitphase.audit.probes import ProbePlan, ProbeResult
from splitphase.audit.report import build_report, validate_report, write_report
from splitphase.audit.steps import Workload, run_steps
from splitphase.audit.trace import RequestTrace
from splitphase.errors import UserError
from splitphase.hardware.specs import get_hardware
from splitphase.model.config import ModelConfig

PLOTS = ("roofline with both phases", "TTFT vs prompt length", "inter-token latency distribution",
         "utilization per phase", "cost before and after")


def _traces() -> list[RequestTrace]:
    """A sequential length sweep and one batched point, with made-up but plausible times."""
    traces, t = [], 0.0
    for n, conc in ((128, 1), (512, 1), (2048, 1), (512, 4), (512, 4), (512, 4), (512, 4)):
        first = t + 0.01 + 2e-5 * n * (2 if conc > 1 else 1)
        times = [first + 0.012 * i * (1 + 0.1 * (i % 3)) for i in range(8)]
        traces.append(RequestTrace(n, 8, t, first, times, times[-1], point=f"len={n} c={conc}",
                                   concurrency=conc))
        t = times[-1] + 0.1 if conc == 1 else t
    return traces


@pytest.fixture(scope="module")
def doc() -> dict:
    cfg, hw = ModelConfig.from_name("llama-3.1-8b"), get_hardware("h100-sxm")
    traces = _traces()
    result = run_steps(traces, cfg, hw, hw.price_usd_per_hour, Workload(10_000, 512, 128))
    plan = ProbePlan((128, 512, 2048), (1, 4), 8, 512, 1)
    target = {"kind": "openai", "spec": "openai:http://x", "concurrent_streams": True}
    report = build_report(result, target, hw, cfg, ProbeResult(plan, traces, 3.0))
    report["_itl"] = list(result.profile.itl_samples_s)
    return report


def _clean(doc: dict) -> dict:
    return {k: v for k, v in doc.items() if k != "_itl"}


def test_report_validates_and_has_the_headline_fields(doc: dict) -> None:
    report = _clean(doc)
    validate_report(report)
    assert report["prefill"]["flops_utilization"] > 0
    assert report["decode"]["bandwidth_utilization"] > 0
    assert report["prefill"]["bound"] in ("compute", "memory")
    assert report["decode"]["bound"] == "memory"
    assert report["cost"]["usd_per_million_output_tokens"] > 0
    for section in ("target", "hardware", "model", "profile", "optimizations"):
        assert report[section]
    json.dumps(report, allow_nan=False)  # strict JSON: no NaN or infinity anywhere


def test_summary_is_written_from_the_numbers(doc: dict) -> None:
    decode_pct = f"{doc['decode']['bandwidth_utilization']:.0%}"
    assert any(f"decode uses {decode_pct} of memory bandwidth" in s.lower()
               for s in doc["summary"])
    assert any("per million" in s for s in doc["summary"])
    decode = next(s for s in doc["summary"] if s.startswith("Decode uses"))
    rate = doc["decode"]["tokens_per_s"]  # the headline's streams; a rate as the tables show it
    shown = f"{rate:,.0f}" if rate >= 100 else f"{rate:,.1f}"
    assert f"{shown} tokens/s over 4 streams" in decode and "(s)" not in decode


def test_schema_rejects_broken_reports(doc: dict) -> None:
    broken = copy.deepcopy(_clean(doc))
    broken["decode"]["bound"] = "network"
    with pytest.raises(UserError, match="decode/bound"):
        validate_report(broken)
    del broken["cost"]
    with pytest.raises(UserError, match="cost"):
        validate_report(broken)


def test_written_report_embeds_every_plot(doc: dict, tmp_path: Path) -> None:
    out = write_report(tmp_path / "r", _clean(doc), doc["_itl"])
    html = (out / "report.html").read_text()
    assert html.count('src="data:image/png;base64,') == len(PLOTS)
    for alt in PLOTS:
        assert f'alt="{alt}"' in html
    assert "<script" not in html and "http://" not in html.replace("openai:http://x", "")
    md = (out / "report.md").read_text()
    assert "## 3. Utilization" in md and "## 5. Cost" in md
    assert "| prefill busy |" in md and "| step time |" in md  # what each phase's time is
    validate_report(json.loads((out / "report.json").read_text()))


def test_a_flat_ttft_fit_is_not_reported_as_growth(doc: dict, tmp_path: Path) -> None:
    grows = write_report(tmp_path / "up", _clean(doc), doc["_itl"])
    slope_us = doc["profile"]["ttft_slope_s_per_token"] * 1e6
    assert slope_us > 0
    assert f"TTFT grows {slope_us:.0f} us per prompt token" in (grows / "report.md").read_text()
    flat = copy.deepcopy(_clean(doc))
    flat["profile"]["ttft_slope_s_per_token"] = -2.6e-5  # noise over short prompts
    out = write_report(tmp_path / "flat", flat, doc["_itl"])
    for page in ("report.md", "report.html"):
        text = (out / page).read_text()
        assert "TTFT grows" not in text
        assert "TTFT does not grow with the prompt at these lengths (fitted slope -26 us" in text


def test_html_opens_in_headless_chromium(
    doc: dict, tmp_path: Path, render_page: Callable[[Path], dict[str, Any]]
) -> None:
    out = write_report(tmp_path / "r", _clean(doc), doc["_itl"])
    page = render_page(out / "report.html")
    assert len(page["images"]) == len(PLOTS) and all(w > 0 for w in page["images"]), page
    assert "splitphase audit" in page["title"]
    assert page["tables"] and all(scroll <= client for scroll, client in page["tables"]), page


def test_money_keeps_three_significant_digits_below_a_dollar() -> None:
    from splitphase.audit.report.fmt import money

    cases = {0.0186: "$0.0186", 0.00556: "$0.00556", 0.1: "$0.100", 0.437: "$0.437",
             0.0: "$0.00", 3.1: "$3.10", 1234.5: "$1,234.50", -0.02: "-$0.0200", -5.0: "-$5.00"}
    assert {x: money(x) for x in cases} == cases
    assert money(None) == "-"


@pytest.mark.parametrize(("target", "cause"), [
    ({"kind": "builtin"}, "or --model-config is larger than the served model."),
    ({"kind": "openai"}, "or --model-config is larger than the served model, or the server "
     "quantizes its weights (pass --quantization)."),
    ({"kind": "openai", "quantization": "fp8", "model_config_source": "served model id 'x'"},
     "or the geometry taken from the served model id 'x' is larger than the served model."),
])
def test_a_level_over_the_peak_names_what_the_audit_may_have_overpriced(
    target: dict[str, Any], cause: str
) -> None:
    from splitphase.audit.report.summary import warnings_for

    level = {"point": "len=32 c=1", "flops_utilization": 0.1, "bandwidth_utilization": 1.2}
    doc = {"prefill": {"levels": []}, "decode": {"levels": [level]},
           "hardware": {"name": "h100-sxm"}, "target": target}
    (warning,) = warnings_for(doc)
    assert warning.startswith("Warning: decode at len=32 c=1 measures above 100%")
    assert warning.endswith(cause)
