"""The plan report: plan.json (best, frontier, every candidate), plan.html and plan.md.

Reuses the audit report's page style, tables and plot helpers.
"""

from __future__ import annotations

import json
from html import escape
from pathlib import Path
from typing import Any

from splitphase.audit.report.fmt import element_bytes, money
from splitphase.audit.report.html import CSS, table_html
from splitphase.audit.report.markdown import table_md
from splitphase.audit.report.plots import BLUE, GREY, ORANGE, pyplot, to_png
from splitphase.errors import UserError
from splitphase.sim.cluster import ClusterConfig, PoolConfig
from splitphase.sim.planner import Candidate, PlanInputs

TABLE_HEADER = ("configuration", "GPUs / unit", "goodput / GPU (req/s)", "GPUs at rate",
                "measured at (req/s)", "TTFT p90", "TPOT p90", "$ / M in", "$ / M out")


def _pool(p: PoolConfig | None) -> dict[str, Any] | None:
    if p is None:
        return None
    s = p.scheduler
    return {"replicas": p.replicas, "tp": p.tp, "policy": s.policy, "role": s.role,
            "max_num_seqs": s.max_num_seqs, "max_num_batched_tokens": s.max_num_batched_tokens,
            "num_kv_blocks": s.num_blocks, "block_size": s.block_size}


def _unit(u: ClusterConfig) -> dict[str, Any]:
    return {"policy": u.policy, "router": u.router, "colocated": _pool(u.colocated),
            "prefill": _pool(u.prefill), "decode": _pool(u.decode), "gpus": u.num_gpus}


def _metrics(m: dict[str, Any] | None) -> dict[str, Any] | None:
    if m is None:
        return None
    return {k: v for k, v in m.items() if not k.endswith("_samples_s")}


def candidate_doc(c: Candidate, price_usd_per_hour: float) -> dict[str, Any]:
    """One candidate, JSON-ready."""
    return {
        "label": c.unit.label(),
        "policy": c.unit.policy,
        "unit": _unit(c.unit),
        "unit_gpus": c.unit_gpus,
        "goodput_rate_per_s": c.goodput_rate_per_s,
        "goodput_per_gpu": c.goodput_per_gpu,
        "probe_limited": c.probe_limited,
        "curve": [[r, a] for r, a in c.curve],
        "at_goodput": _metrics(c.at_goodput),
        "copies_at_rate": c.copies,
        "gpus_at_rate": c.gpus_needed,
        "usd_per_hour_at_rate": (None if c.gpus_needed is None
                                 else c.gpus_needed * price_usd_per_hour),
        "at_rate": _metrics(c.verified),
    }


def _frontier(cands: list[Candidate]) -> list[dict[str, Any]]:
    """Pareto frontier: the best goodput per GPU for each unit size, kept only if it beats
    every smaller unit."""
    best: dict[int, Candidate] = {}
    for c in cands:
        if c.goodput_per_gpu > 0 and (c.unit_gpus not in best
                                      or c.goodput_per_gpu > best[c.unit_gpus].goodput_per_gpu):
            best[c.unit_gpus] = c
    out, top = [], 0.0
    for gpus in sorted(best):
        c = best[gpus]
        if c.goodput_per_gpu > top:
            top = c.goodput_per_gpu
            out.append({"unit_gpus": gpus, "label": c.unit.label(),
                        "goodput_per_gpu": c.goodput_per_gpu})
    return out


def _top(cands: list[Candidate], policies: tuple[str, ...]) -> Candidate | None:
    pool = [c for c in cands if c.unit.policy in policies and c.goodput_per_gpu > 0]
    return max(pool, key=lambda c: c.goodput_per_gpu, default=None)


def _goodput_line(colo: Candidate, dis: Candidate, ratio: float) -> str:
    """Which deployment serves more per GPU, or a tie where the searches cannot tell."""
    (c_lo, c_hi), (d_lo, d_hi) = colo.goodput_per_gpu_bounds(), dis.goodput_per_gpu_bounds()
    if d_lo < c_hi and c_lo < d_hi:
        verdict = "a tie within the goodput search's resolution"
    else:
        verdict = ("disaggregated" if ratio > 1 else "colocated") + " wins"
    return (f"Goodput per GPU: best disaggregated {dis.goodput_per_gpu:.3g} vs best colocated "
            f"{colo.goodput_per_gpu:.3g} req/s ({colo.unit.policy}): {ratio:.2f}x, {verdict}.")


def _gpus(n: int) -> str:
    return f"{n} GPU{'' if n == 1 else 's'}"


def _prefix_note(hit_rate: float | None) -> str:
    if hit_rate is None:
        return ""
    return (f" {hit_rate:.0%} of its prompt tokens were found in the replicas' prefix caches"
            " (the workload's shared prefix blocks) and not prefilled again.")


def _lengths_note(verified: dict[str, Any]) -> str:
    p = verified.get("prompt_tokens")
    if not p:
        return ""
    return (f" Its {verified['requests']} measured requests' prompts: mean {p['mean']:,.0f},"
            f" p90 {p['p90']:,.0f}, longest {p['max']:,.0f} tokens.")


def build_plan(inp: PlanInputs, best: Candidate | None, cands: list[Candidate]
               ) -> dict[str, Any]:
    """plan.json as a dict."""
    price = inp.hardware.price_usd_per_hour
    colo, dis = _top(cands, ("mixed", "chunked")), _top(cands, ("disaggregated",))
    ratio = dis.goodput_per_gpu / colo.goodput_per_gpu if colo and dis else None
    summary = []
    if best is None:
        summary.append(f"No configuration within {_gpus(inp.max_gpus)} meets TTFT <= "
                       f"{inp.slo.ttft_s:g} s and TPOT <= {inp.slo.tpot_s:g} s for "
                       f"{inp.slo.attainment:.0%} of requests at {inp.rate_per_s:g} req/s.")
    else:
        v = best.verified or {}
        summary.append(
            f"Cheapest: {best.unit.label()} x {best.copies} = {_gpus(best.gpus_needed or 0)} "
            f"(${(best.gpus_needed or 0) * price:.2f}/hour) serves {inp.rate_per_s:g} req/s with "
            f"{v.get('slo_attainment', 0):.0%} of requests inside both SLOs."
            + _prefix_note(v.get("prefix_cache_hit_rate")) + _lengths_note(v))
    if colo and dis and ratio is not None:
        summary.append(_goodput_line(colo, dis, ratio))
    return {
        "model": inp.model.name,
        "hardware": {"name": inp.hardware.name, "price_usd_per_hour": price,
                     "source": inp.hardware.source},
        "workload": inp.workload.describe(),
        "rate_per_s": inp.rate_per_s,
        "slo": {"ttft_s": inp.slo.ttft_s, "tpot_s": inp.slo.tpot_s,
                "attainment": inp.slo.attainment},
        "max_gpus": inp.max_gpus,
        "num_requests": inp.num_requests,
        "warmup_fraction": inp.warmup_fraction,
        "efficiency": inp.efficiency.to_dict(),
        "kv_dtype_bytes": inp.kv_dtype_bytes,  # None: bf16, as the activations
        "weights": None if inp.weights is None else {  # None: bf16
            "format": inp.weights.name, "bytes_per_param": inp.weights.bytes_per_param,
            "compute_dtype": inp.weights.compute_dtype},
        "kv_link": {"name": inp.link.name, "bytes_per_s": inp.link.bytes_per_s,
                    "latency_s": inp.link.latency_s},
        "router": inp.router,
        "summary": summary,
        "best": None if best is None else {
            **candidate_doc(best, price),
            "usd_per_million_input_tokens": (best.verified or {}).get(
                "usd_per_million_input_tokens"),
            "usd_per_million_output_tokens": (best.verified or {}).get(
                "usd_per_million_output_tokens"),
        },
        "best_colocated": None if colo is None else colo.unit.label(),
        "best_disaggregated": None if dis is None else dis.unit.label(),
        "disaggregated_over_colocated_goodput": ratio,
        "frontier": _frontier(cands),
        "candidates": [candidate_doc(c, price) for c in cands],
    }


def _row(c: dict[str, Any], rate: float) -> list[str]:
    def ms(m: dict[str, Any] | None, k: str) -> str:
        return "" if not m else f"{m[k]['p90_s'] * 1e3:.0f} ms"

    def usd(m: dict[str, Any] | None, k: str) -> str:
        return "" if not m or m.get(k) is None else money(m[k])

    # Latency and cost at the target rate when the configuration was sized for it, else at
    # its own goodput (one unit, fully loaded).
    m = c["at_rate"] or c["at_goodput"]
    at = rate if c["at_rate"] else c["goodput_rate_per_s"]
    return [c["label"], str(c["unit_gpus"]), f"{c['goodput_per_gpu']:.3g}",
            str(c["gpus_at_rate"] or ""), f"{at:.3g}" if m else "", ms(m, "ttft"), ms(m, "tpot"),
            usd(m, "usd_per_million_input_tokens"), usd(m, "usd_per_million_output_tokens")]


def plots(doc: dict[str, Any], cands: list[Candidate]) -> dict[str, str]:
    """Attainment vs rate per GPU (top configurations) and TTFT/TPOT distributions."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.2, 3.8))
    for c in sorted(cands, key=lambda c: -c.goodput_per_gpu)[:8]:
        if c.curve:
            ax.plot([r / c.unit_gpus for r, _ in c.curve], [a * 100 for _, a in c.curve],
                    marker="o", ms=3, label=c.unit.label()[:60])
    ax.axhline(doc["slo"]["attainment"] * 100, color=GREY, ls="--", lw=1)
    ax.set_xlabel("request rate per GPU (req/s)")
    ax.set_ylabel("requests meeting both SLOs (%)")
    ax.set_title("SLO attainment vs rate: goodput is where a line crosses the target")
    ax.legend(fontsize=6, frameon=False)
    out = {"goodput": to_png(fig)}
    tops = [(color, top) for color, policies in ((BLUE, ("mixed", "chunked")),
                                                 (ORANGE, ("disaggregated",)))
            if (top := _top(cands, policies)) is not None and top.verified]
    if not tops:  # nothing was simulated at the target rate: no distribution to draw
        return out
    fig, axes = plt.subplots(1, 2, figsize=(8.4, 3.2))
    for color, top in tops:
        assert top.verified is not None
        for ax, key, slo in ((axes[0], "ttft_samples_s", doc["slo"]["ttft_s"]),
                             (axes[1], "tpot_samples_s", doc["slo"]["tpot_s"])):
            xs = sorted(v * 1e3 for v in top.verified[key])
            ax.plot(xs, [100 * (i + 1) / len(xs) for i in range(len(xs))], color=color,
                    label=top.unit.policy)
            ax.axvline(slo * 1e3, color=GREY, ls=":", lw=1)
    axes[0].set_xlabel("TTFT (ms)")
    axes[1].set_xlabel("TPOT (ms)")
    axes[0].set_ylabel("requests (%), CDF at the target rate")
    axes[0].legend(frameon=False)
    out["latency"] = to_png(fig)
    return out


def _kv_note(doc: dict[str, Any]) -> str:
    width, weights = doc.get("kv_dtype_bytes"), doc.get("weights")
    kv = "" if width is None else f"; K/V cache {element_bytes(width)}"
    return kv if weights is None else (f"; weights {weights['format']} "
                                       f"(matmuls in {weights['compute_dtype']})" + kv)


def _runs_note(doc: dict[str, Any]) -> str:
    n, f, wl = doc["num_requests"], doc["warmup_fraction"], doc["workload"]
    where = ("" if "trace_start" not in wl else f", replaying the trace from its request "
             f"{wl['trace_start']} (of {wl['trace_requests']}, counted from 0)")
    if not f:
        return f"each simulation measures its requests ({n} or more) from an empty cluster{where}"
    return (f"each simulation measures its requests ({n} or more) after {f:.0%} as many "
            f"that warm the cluster{where}")


def write_plan(out_dir: str | Path, doc: dict[str, Any], cands: list[Candidate]) -> Path:
    """Write plan.json, plan.html and plan.md into `out_dir`."""
    out = Path(out_dir)
    rows = [_row(c, doc["rate_per_s"])
            for c in sorted(doc["candidates"], key=lambda c: -c["goodput_per_gpu"])]
    figs = plots(doc, cands)
    front_header = ("GPUs per unit", "best configuration", "goodput / GPU (req/s)")
    front = [[str(f["unit_gpus"]), f["label"], f"{f['goodput_per_gpu']:.3g}"]
             for f in doc["frontier"]]
    summary = "".join(f"<li>{escape(s)}</li>" for s in doc["summary"])
    imgs = "".join(f'<figure><img alt="{k}" src="data:image/png;base64,{v}"></figure>'
                   for k, v in figs.items())
    wl = doc["workload"]
    page = (
        '<!doctype html><html lang="en"><head><meta charset="utf-8"><title>splitphase plan'
        f'</title><style>{CSS}</style></head><body><main><header><h1>splitphase plan</h1>'
        f'<div class="meta">{escape(doc["model"])} on {escape(doc["hardware"]["name"])}, '
        f'workload {escape(str(wl["name"]))} at {doc["rate_per_s"]:g} req/s; SLOs TTFT '
        f'{doc["slo"]["ttft_s"]:g} s, TPOT {doc["slo"]["tpot_s"]:g} s{_kv_note(doc)}; '
        f'{escape(_runs_note(doc))}</div></header>'
        f'<div class="summary"><ul>{summary}</ul></div><section>{imgs}'
        f'<h2>Goodput frontier</h2>{table_html(front_header, front, wide_cols=(1,))}'
        f'<h2>Every configuration</h2>{table_html(TABLE_HEADER, rows, wide_cols=(0,))}'
        '</section></main>'
        '</body></html>'
    )
    md = ("# splitphase plan\n\n" + "".join(f"- {s}\n" for s in doc["summary"])
          + f"\n{_runs_note(doc).capitalize()}.\n"
          + "\n## Goodput frontier\n\n" + table_md(front_header, front)
          + "\n## Every configuration\n\n" + table_md(TABLE_HEADER, rows))
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan.json").write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")
        (out / "plan.html").write_text(page, encoding="utf-8")
        (out / "plan.md").write_text(md, encoding="utf-8")
    except OSError as exc:
        raise UserError(f"cannot write the plan to {out}: {exc.strerror or exc}") from exc
    return out
