"""The self-contained HTML report: summary first, then the five steps, plots inlined as PNGs."""

from __future__ import annotations

from collections.abc import Sequence
from html import escape
from typing import Any

from splitphase.audit.report import fmt

CSS = """
:root { --ink:#111827; --muted:#6b7280; --line:#e5e7eb; --bg:#f8fafc; --card:#ffffff;
  --blue:#2563eb; --orange:#ea580c; --red:#dc2626; --green:#16a34a; --amber:#b45309; }
* { box-sizing: border-box; }
body { margin:0; background:var(--bg); color:var(--ink);
  font:15px/1.55 -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; }
main { max-width: 1040px; margin: 0 auto; padding: 32px 24px 64px; }
header h1 { margin: 0 0 4px; font-size: 26px; letter-spacing: -0.01em; }
header .meta { color: var(--muted); font-size: 13px; }
.summary { background: var(--card); border: 1px solid var(--line);
  border-left: 4px solid var(--blue);
  border-radius: 10px; padding: 16px 20px; margin: 20px 0; }
.summary li { margin: 4px 0; }
.warn { background: #fffbeb; border: 1px solid #fde68a; color: var(--amber); border-radius: 10px;
  padding: 10px 16px; margin: 12px 0; font-size: 14px; }
.cards { display: grid; grid-template-columns: repeat(auto-fit, minmax(150px, 1fr)); gap: 12px;
  margin: 16px 0 8px; }
.card { background: var(--card); border: 1px solid var(--line); border-radius: 10px;
  padding: 12px 14px; }
.card .k { color: var(--muted); font-size: 12px; text-transform: uppercase; letter-spacing: .04em; }
.card .v { font-size: 24px; font-weight: 650; margin-top: 2px; }
.card .v.gap { color: var(--red); } .card .v.ok { color: var(--green); }
section { background: var(--card); border: 1px solid var(--line); border-radius: 12px;
  padding: 18px 22px; margin: 18px 0; }
section h2 { margin: 0 0 4px; font-size: 19px; }
section h2 .n { color: var(--muted); font-weight: 500; margin-right: 6px; }
section p.lead { color: var(--muted); margin: 0 0 12px; font-size: 14px; }
figure { margin: 12px 0; text-align: center; }
figure img { max-width: 100%; height: auto; }
.table-wrap { overflow-x: auto; }
table { border-collapse: collapse; width: 100%; font-size: 13px; margin: 8px 0; }
th, td { padding: 6px 10px; border-bottom: 1px solid var(--line); text-align: right;
  white-space: nowrap; }
th:first-child, td:first-child { text-align: left; }
th { color: var(--muted); font-weight: 600; background: #f9fafb; }
td.text, th.text { text-align: left; white-space: normal; min-width: 160px; }
.badge { display: inline-block; padding: 1px 8px; border-radius: 999px; font-size: 12px; }
.measured { background: #dcfce7; color: #166534; }
.projected { background: #e0e7ff; color: #3730a3; }
.na { color: var(--muted); }
footer { color: var(--muted); font-size: 12px; margin-top: 24px; }
"""


def table_html(
    header: Sequence[str], rows: Sequence[Sequence[str]], raw: bool = False,
    wide_cols: Sequence[int] = (),
) -> str:
    """A table; cells are escaped unless `raw` (already-built HTML); `wide_cols` wrap text."""
    head = "".join(
        f'<th class="text">{escape(h)}</th>' if i in wide_cols else f"<th>{escape(h)}</th>"
        for i, h in enumerate(header)
    )

    def cell(i: int, value: str) -> str:
        cls = ' class="text"' if i in wide_cols else ""
        return f"<td{cls}>{value if raw else escape(value)}</td>"

    body = "".join(
        "<tr>" + "".join(cell(i, v) for i, v in enumerate(row)) + "</tr>" for row in rows
    )
    return f'<div class="table-wrap"><table><tr>{head}</tr>{body}</table></div>'


def _figure(plots: dict[str, str], name: str, alt: str) -> str:
    return f'<figure><img alt="{escape(alt)}" src="data:image/png;base64,{plots[name]}"></figure>'


def _section(n: int, title: str, lead: str, body: str) -> str:
    return (
        f'<section id="step{n}"><h2><span class="n">{n}</span>{escape(title)}</h2>'
        f'<p class="lead">{escape(lead)}</p>{body}</section>'
    )


def _cards(doc: dict[str, Any]) -> str:
    pre, dec, cost = doc["prefill"], doc["decode"], doc["cost"]
    cards = [
        ("prefill FLOP use", fmt.pct(pre["flops_utilization"]), pre["gap"]),
        ("decode bandwidth use", fmt.pct(dec["bandwidth_utilization"]), dec["gap"]),
        ("prefill is", f"{pre['bound']}-bound", None),
        ("decode is", f"{dec['bound']}-bound", None),
        ("$ / M output tokens", fmt.money(cost["usd_per_million_output_tokens"]), None),
        ("$ / M input tokens", fmt.money(cost["usd_per_million_input_tokens"]), None),
    ]
    html = ""
    for key, value, gap in cards:
        cls = "" if gap is None else (" gap" if gap else " ok")
        html += (
            f'<div class="card"><div class="k">{escape(key)}</div>'
            f'<div class="v{cls}">{escape(value)}</div></div>'
        )
    return f'<div class="cards">{html}</div>'


def _profile(doc: dict[str, Any], plots: dict[str, str]) -> str:
    prof = doc["profile"]
    rows = [
        [
            p["point"],
            str(p["n"]),
            f"{p['prompt_tokens']:.0f}",
            fmt.seconds(p["ttft"]["p50_s"]),
            fmt.seconds(p["ttft"]["p99_s"]),
            fmt.seconds(p["prefill"]["p50_s"]),
            fmt.seconds(p["itl"]["p50_s"]),
            fmt.seconds(p["itl"]["p99_s"]),
            f"{p['decode_batch']:.1f}",
        ]
        for p in prof["points"]
    ]
    table = table_html(
        [
            "point",
            "requests",
            "prompt",
            "TTFT p50",
            "TTFT p99",
            "prefill p50",
            "ITL p50",
            "ITL p99",
            "decode batch",
        ],
        rows,
    )
    fit = fmt.ttft_slope(prof["ttft_slope_s_per_token"], prof["ttft_fit_r2"])
    inter = prof["interference"]
    inter_txt = (
        f"Prefill interference (measured): running streams' inter-token latency was "
        f"{fmt.seconds(inter['during_prefill_itl_s'])} (mean) while "
        f"{inter['inject_prompt_tokens']:.0f}-token prompts were prefilled, against "
        f"{fmt.seconds(inter['baseline_itl_s'])} (p50) otherwise: {inter['spike']:.2f}x."
        if inter
        else "Prefill interference was not measured on this target (see step 4)."
    )
    body = (
        _figure(plots, "ttft", "TTFT vs prompt length") + f"<p>{escape(fit)}Phase times are "
        f"{escape(prof['source'])}-side. {escape(inter_txt)}</p>"
        + table
        + _figure(plots, "itl", "inter-token latency distribution")
    )
    return _section(
        1,
        "Profile",
        "Prefill time (TTFT minus queue) and decode time "
        "(inter-token gaps) per probe point, with percentiles.",
        body,
    )


def _bottleneck(doc: dict[str, Any], plots: dict[str, str]) -> str:
    rows = [
        [
            ph,
            f"{doc[ph]['intensity_flop_per_byte']:.3g}",
            f"{doc[ph]['ridge_flop_per_byte']:.3g}",
            doc[ph]["bound"],
            fmt.si(doc[ph]["attainable_flops_per_s"], "FLOP/s"),
        ]
        for ph in ("prefill", "decode")
    ]
    body = _figure(plots, "roofline", "roofline with both phases") + table_html(
        ["phase", "intensity (FLOP/byte)", "ridge point", "bound", "attainable"], rows
    )
    return _section(
        2,
        "Bottleneck per phase",
        "Each phase's arithmetic intensity against the "
        "hardware's ridge point: left of it memory-bound, right of it compute-bound.",
        body,
    )


def _utilization(doc: dict[str, Any], plots: dict[str, str]) -> str:
    body = _figure(plots, "utilization", "utilization per phase")
    for phase in ("prefill", "decode"):
        table = table_html(fmt.level_header(phase), fmt.level_rows(doc, phase))
        body += f"<h3>{phase}</h3>" + table
    marginal = doc["prefill"].get("marginal_flops_utilization")
    if marginal is not None:
        body += (
            f"<p>Marginal prefill FLOP utilization (extra FLOPs per extra prompt token over "
            f"the TTFT slope): {escape(fmt.pct(marginal))}.</p>"
        )
    return _section(
        3,
        "Utilization",
        "Prefill: analytical FLOPs / measured time / peak FLOP/s. "
        "Decode: bytes per step (weights + KV of the batch) / step time / peak "
        "bandwidth. Under 50% is flagged as a gap.",
        body,
    )


def _optimizations(doc: dict[str, Any]) -> str:
    rows = []
    for o in doc["optimizations"]:
        badge = f'<span class="badge {o["evidence"]}">{o["evidence"]}</span>'
        name = (
            escape(o["name"])
            if o["applicable"]
            else f'<span class="na">{escape(o["name"])} (n/a)</span>'
        )
        rows.append(
            [
                name,
                escape(o["phase"]),
                badge,
                escape(o["metric"]),
                escape(fmt.metric_value(o["before"], o["unit"])),
                escape(fmt.metric_value(o["after"], o["unit"])),
                escape(fmt.speedup(o["speedup"])),
                escape(o["detail"]),
            ]
        )
    return _section(
        4,
        "Phase-specific optimizations",
        "Measured where the probe allows; "
        "otherwise projected with the FLOP/byte model at the efficiency this target "
        "already reaches.",
        table_html(
            ["change", "phase", "evidence", "metric", "before", "after", "gain", "why"],
            rows,
            raw=True,
            wide_cols=(3, 7),
        ),
    )


def _cost(doc: dict[str, Any], plots: dict[str, str]) -> str:
    c = doc["cost"]
    rows = [
        [
            label,
            fmt.rate(r["prefill_tokens_per_s"]),
            fmt.rate(r["decode_tokens_per_s"]),
            fmt.money(r["usd_per_million_input_tokens"]),
            fmt.money(r["usd_per_million_output_tokens"]),
            fmt.money(r["monthly_usd"]),
        ]
        for label, r in (("now", c["now"]), ("achievable", c["achievable"]))
    ]
    table = table_html(
        ["", "prefill tokens/s", "decode tokens/s", "$ / M input", "$ / M output", "monthly bill"],
        rows,
    )
    saving = (
        f"<p><b>Monthly saving: {escape(fmt.money(c['monthly_savings_usd']))} "
        f"({c['savings_fraction']:.0%}).</b></p>"
    )
    items = "".join(f"<li>{escape(a)}</li>" for a in c["assumptions"])
    body = _figure(plots, "cost", "cost before and after") + table + saving + f"<ul>{items}</ul>"
    return _section(
        5,
        "Cost",
        "Dollars per million tokens now and at achievable utilization, "
        "and the monthly bill of the stated workload.",
        body,
    )


def render_html(doc: dict[str, Any], plots: dict[str, str]) -> str:
    """The whole report page (no external resources)."""
    t, hw, model = doc["target"], doc["hardware"], doc["model"]
    meta = (
        f"{t['spec']} · {hw['name']} ({hw['dtype']}) · model {model['name']} "
        f"({fmt.model_details(doc)}) · "
        f"{doc.get('generated_at', '')}"
    )
    summary = "".join(
        f"<li>{escape(s)}</li>" for s in doc["summary"] if not s.startswith("Warning")
    )
    warnings = "".join(f'<div class="warn">{escape(w)}</div>' for w in doc["warnings"])
    probe = doc["probe"]
    footer = (
        f"Probe: prompt lengths {probe['prompt_lens']}, concurrency "
        f"{probe['concurrency_levels']}, {probe['output_tokens']} output tokens"
        f"{' (quick)' if probe['quick'] else ''}; {probe.get('n_requests', 0)} requests in "
        f"{probe.get('duration_s', 0):.1f} s. Hardware: {hw['source']}. "
        f"splitphase {doc.get('splitphase_version', '')}, report schema {doc['schema_version']}."
    )
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>splitphase audit: {escape(t['spec'])}</title><style>{CSS}</style>"
        "</head><body><main>"
        f'<header><h1>splitphase audit</h1><div class="meta">{escape(meta)}</div></header>'
        f'<div class="summary"><ul>{summary}</ul></div>{warnings}{_cards(doc)}'
        + _profile(doc, plots)
        + _bottleneck(doc, plots)
        + _utilization(doc, plots)
        + _optimizations(doc)
        + _cost(doc, plots)
        + f"<footer>{escape(footer)}</footer></main></body></html>\n"
    )
