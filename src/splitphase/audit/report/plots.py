"""The report's figures as base64 PNGs (matplotlib, Agg backend), drawn from report.json alone."""

from __future__ import annotations

import base64
import io
from typing import Any

from splitphase.audit.report.fmt import money
from splitphase.errors import UserError

BLUE, ORANGE, GREY, RED, GREEN = "#2563eb", "#ea580c", "#6b7280", "#dc2626", "#16a34a"


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, with the report's style."""
    try:
        import matplotlib
    except ImportError as exc:  # pragma: no cover - matplotlib is a report dependency
        raise UserError("the HTML report needs matplotlib: pip install matplotlib") from exc
    matplotlib.use("Agg")  # no display; must precede pyplot's import
    import matplotlib.pyplot as plt

    plt.rcParams.update({
        "figure.dpi": 110, "font.size": 9, "axes.spines.top": False,
        "axes.spines.right": False, "axes.grid": True, "grid.alpha": 0.25,
    })
    return plt


def to_png(fig: Any) -> str:
    """A figure as a base64 PNG (the figure is closed)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    pyplot().close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def roofline(doc: dict[str, Any]) -> str:
    """Both phases' probe points under the hardware's roofline (log-log)."""
    plt = pyplot()
    hw = doc["hardware"]
    peak, bw = hw["peak_flops_per_s"], hw["mem_bandwidth_bytes_per_s"]
    points = [(lv, ph) for ph in ("prefill", "decode") for lv in doc[ph]["levels"]]
    xs = [lv["intensity_flop_per_byte"] for lv, _ in points] + [hw["ridge_flop_per_byte"]]
    lo, hi = min(xs) / 4, max(xs) * 4
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    ax.loglog(grid, [min(peak, x * bw) for x in grid], color=GREY, lw=2, label="roofline")
    ax.axvline(hw["ridge_flop_per_byte"], color=GREY, ls=":", lw=1)
    for phase, color in (("prefill", BLUE), ("decode", ORANGE)):
        lvs = doc[phase]["levels"]
        ax.scatter([lv["intensity_flop_per_byte"] for lv in lvs],
                   [max(lv["achieved_flops_per_s"], 1.0) for lv in lvs],
                   color=color, s=36, zorder=3, label=f"{phase} (measured)")
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("FLOP/s")
    ax.set_title(f"Roofline: {hw['name']} ({hw['dtype']}), ridge at "
                 f"{hw['ridge_flop_per_byte']:.3g} FLOP/byte")
    ax.legend(loc="lower right", frameon=False)
    return to_png(fig)


def ttft_vs_prompt(doc: dict[str, Any]) -> str:
    """Prefill time per point against prompt length, with the least-squares line."""
    plt = pyplot()
    prof = doc["profile"]
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    for conc in sorted({p["concurrency"] for p in prof["points"]}):
        pts = [p for p in prof["points"] if p["concurrency"] == conc]
        xs = [p["prompt_tokens"] for p in pts]
        ys = [p["prefill"]["p50_s"] * 1e3 for p in pts]
        err = [[0] * len(pts), [(p["prefill"]["p90_s"] - p["prefill"]["p50_s"]) * 1e3 for p in pts]]
        ax.errorbar(xs, ys, yerr=err, fmt="o", capsize=3, label=f"concurrency {conc} (p50, p90)")
    slope, icpt = prof["ttft_slope_s_per_token"], prof["ttft_intercept_s"]
    if slope is not None and icpt is not None:
        xs = sorted(p["prompt_tokens"] for p in prof["points"])
        ax.plot([0, xs[-1]], [icpt * 1e3, (icpt + slope * xs[-1]) * 1e3], color=GREY, ls="--",
                label=f"fit: {slope * 1e6:.1f} us/token + {icpt * 1e3:.1f} ms")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("prefill time (ms)")
    ax.set_title("Time to first token vs prompt length")
    ax.legend(frameon=False)
    return to_png(fig)


def itl_distribution(doc: dict[str, Any], samples_s: list[float]) -> str:
    """Histogram of inter-token gaps with p50 and p99 marked."""
    plt = pyplot()
    itl = doc["profile"]["itl"]
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    ax.hist([s * 1e3 for s in samples_s] or [0.0], bins=40, color=ORANGE, alpha=0.8)
    for q, ls in (("p50_s", "-"), ("p99_s", "--")):
        ax.axvline(itl[q] * 1e3, color=GREY, ls=ls, label=f"{q[:3]} {itl[q] * 1e3:.2f} ms")
    ax.set_xlabel("inter-token latency (ms)")
    ax.set_ylabel("tokens")
    ax.set_title("Inter-token latency distribution")
    ax.legend(frameon=False)
    return to_png(fig)


def utilization_bars(doc: dict[str, Any]) -> str:
    """Prefill FLOP utilization and decode bandwidth utilization at every probe point."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(8.4, 3.2), sharey=True)
    for ax, phase, key, color in ((axes[0], "prefill", "flops_utilization", BLUE),
                                  (axes[1], "decode", "bandwidth_utilization", ORANGE)):
        lvs = doc[phase]["levels"]
        vals = [lv[key] * 100 for lv in lvs]
        ax.bar(range(len(lvs)), vals, color=[color if v >= 50 else RED for v in vals])
        ax.axhline(50, color=GREY, ls="--", lw=1)
        ax.set_xticks(range(len(lvs)), [lv["point"] for lv in lvs], rotation=30, ha="right")
        ax.set_title(f"{phase}: {'FLOP' if key.startswith('flops') else 'bandwidth'} utilization")
    axes[0].set_ylabel("% of peak (red: under 50%)")
    return to_png(fig)


def cost_bars(doc: dict[str, Any]) -> str:
    """Dollars per million input and output tokens, now and at achievable utilization."""
    plt = pyplot()
    c = doc["cost"]
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    keys = ("usd_per_million_input_tokens", "usd_per_million_output_tokens")
    for i, (label, rates, color) in enumerate((("now", c["now"], GREY),
                                               ("achievable", c["achievable"], GREEN))):
        bars = ax.bar([k + i * 0.38 for k in range(2)], [rates[k] for k in keys], width=0.38,
                      color=color, label=label)
        ax.bar_label(bars, labels=[money(rates[k]) for k in keys], fontsize=8, padding=2)
    ax.set_xticks([0.19, 1.19], ["input tokens", "output tokens"])
    ax.set_ylabel("$ per million tokens")
    ax.set_title(f"Cost at ${c['price_usd_per_hour']:.2f}/hour")
    ax.margins(y=0.15)  # room for the value labels
    ax.legend(frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return to_png(fig)


def all_plots(doc: dict[str, Any], itl_samples_s: list[float]) -> dict[str, str]:
    """Name -> base64 PNG for every figure of the report."""
    return {
        "roofline": roofline(doc),
        "ttft": ttft_vs_prompt(doc),
        "itl": itl_distribution(doc, itl_samples_s),
        "utilization": utilization_bars(doc),
        "cost": cost_bars(doc),
    }
