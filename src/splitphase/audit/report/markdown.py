"""The Markdown report: the same sections and tables as the HTML page, without the plots."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from splitphase.audit.report import fmt


def table_md(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-flavoured Markdown table."""
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(header), line(["---"] * len(header)), *map(line, rows)]) + "\n"


def _profile(doc: dict[str, Any]) -> str:
    prof = doc["profile"]
    rows = [
        [p["point"], str(p["n"]), f"{p['prompt_tokens']:.0f}", fmt.seconds(p["ttft"]["p50_s"]),
         fmt.seconds(p["ttft"]["p99_s"]), fmt.seconds(p["itl"]["p50_s"]),
         fmt.seconds(p["itl"]["p99_s"]), f"{p['decode_batch']:.1f}"]
        for p in prof["points"]
    ]
    text = "## 1. Profile\n\n" + fmt.ttft_slope(prof["ttft_slope_s_per_token"], prof["ttft_fit_r2"])
    text += f"Phase times are {prof['source']}-side.\n\n"
    header = ["point", "requests", "prompt", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "batch"]
    return text + table_md(header, rows)


def _phases(doc: dict[str, Any]) -> str:
    text = "## 2. Bottleneck per phase\n\n" + table_md(
        ["phase", "intensity (FLOP/byte)", "ridge point", "bound"],
        [[ph, f"{doc[ph]['intensity_flop_per_byte']:.3g}",
          f"{doc[ph]['ridge_flop_per_byte']:.3g}", doc[ph]["bound"]]
         for ph in ("prefill", "decode")],
    )
    text += "\n## 3. Utilization\n\n"
    for phase in ("prefill", "decode"):
        table = table_md(fmt.level_header(phase), fmt.level_rows(doc, phase))
        text += f"### {phase}\n\n{table}\n"
    return text


def _optimizations(doc: dict[str, Any]) -> str:
    rows = [
        [o["name"] + ("" if o["applicable"] else " (n/a)"), o["phase"], o["evidence"],
         fmt.metric_value(o["before"], o["unit"]), fmt.metric_value(o["after"], o["unit"]),
         fmt.speedup(o["speedup"]), o["detail"]]
        for o in doc["optimizations"]
    ]
    header = ["change", "phase", "evidence", "before", "after", "gain", "why"]
    return "## 4. Phase-specific optimizations\n\n" + table_md(header, rows)


def _cost(doc: dict[str, Any]) -> str:
    c = doc["cost"]
    rows = [
        [label, fmt.money(r["usd_per_million_input_tokens"]),
         fmt.money(r["usd_per_million_output_tokens"]), fmt.money(r["monthly_usd"])]
        for label, r in (("now", c["now"]), ("achievable", c["achievable"]))
    ]
    text = "## 5. Cost\n\n" + table_md(["", "$ / M input", "$ / M output", "monthly bill"], rows)
    text += f"\nMonthly saving: {fmt.money(c['monthly_savings_usd'])}.\n\nAssumptions:\n\n"
    return text + "".join(f"- {a}\n" for a in c["assumptions"])


def render_markdown(doc: dict[str, Any]) -> str:
    """The whole report as Markdown."""
    t, hw, model = doc["target"], doc["hardware"], doc["model"]
    head = (
        f"# splitphase audit: {t['spec']}\n\n"
        f"{hw['name']} ({hw['dtype']}), model {model['name']} "
        f"({fmt.model_details(doc)}), "
        f"{doc.get('generated_at', '')}\n\n"
        + "".join(f"- {line}\n" for line in doc["summary"])
        + "\n"
    )
    return "\n".join([head, _profile(doc), _phases(doc), _optimizations(doc), _cost(doc)])
