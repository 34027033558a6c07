"""The Dual-Flow quality bench's results in words and tables (bench/dual_flow_quality.py).

A results document holds, per row, its seeds' losses, their summary and the row's costs; here
they become the verdict (does Dual-Flow beat the baseline by more than two standard deviations
of the difference?) and the plain-text and README tables.
"""

from __future__ import annotations

import math
import statistics
from typing import Any


def summarize(seeds: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Mean and sample standard deviation over seeds (std is None with one seed)."""
    out: dict[str, Any] = {"n": len(seeds)}
    for key in ("loss", "continuation_loss"):
        xs = [r[key] for r in seeds.values() if r[key] is not None]
        out[f"{key}_mean"] = statistics.fmean(xs) if xs else None
        out[f"{key}_std"] = statistics.stdev(xs) if len(xs) > 1 else None
    return out


def compare(doc: dict[str, Any], ref: str, name: str) -> tuple[float, float] | None:
    """(margin of name below ref in val NLL, sd of a single-seed difference) or None."""
    rows = doc["rows"]
    a, b = rows.get(ref, {}).get("summary"), rows.get(name, {}).get("summary")
    if a is None or b is None or a["loss_std"] is None or b["loss_std"] is None:
        return None
    return a["loss_mean"] - b["loss_mean"], math.hypot(a["loss_std"], b["loss_std"])


def verdict(doc: dict[str, Any]) -> dict[str, Any]:
    """Dual-Flow against rows 1, 3, 4: margins in units of sqrt(std_a^2 + std_b^2)."""
    out: dict[str, Any] = {}
    for ref in ("baseline", "baseline-2x-tokens", f"baseline-{doc['settings']['matched']}"):
        got = compare(doc, ref, "dual-flow")
        if got is not None:
            margin, sd = got
            out[ref] = {"margin": margin, "sd": sd, "sds": margin / sd if sd else math.inf,
                        "beats_by_2sd": margin > 2 * sd}
    return out


def verdict_line(doc: dict[str, Any]) -> str:
    """The final line: does Dual-Flow beat the baseline by more than two standard deviations?"""
    v = doc.get("verdict", {}).get("baseline")
    if v is None:
        return ("VERDICT: undetermined: needs the rows baseline and dual-flow with >= 2 seeds each")
    rows = doc["rows"]
    b, d = rows["baseline"]["summary"], rows["dual-flow"]["summary"]
    word = "YES" if v["beats_by_2sd"] else "NO"
    return (f"VERDICT: Dual-Flow beats the baseline by more than two standard deviations: {word} "
            f"(val NLL {d['loss_mean']:.4f} ± {d['loss_std']:.4f} vs {b['loss_mean']:.4f} ± "
            f"{b['loss_std']:.4f}; margin {v['margin']:+.4f} = {v['sds']:.1f} sd, "
            f"sd = sqrt(std_b^2 + std_d^2) = {v['sd']:.4f}; {d['n']} and {b['n']} seeds)")


def compact_si(x: float, unit: str = "") -> str:
    """3.21G, 512.00k, 1.50GB: two decimals, no space (for narrow table columns)."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f}{prefix}{unit}"
    return f"{x:.0f}{unit}"


def _pm(summary: dict[str, Any], key: str) -> str:
    mean, std = summary.get(f"{key}_mean"), summary.get(f"{key}_std")
    if mean is None:
        return "-"
    return f"{mean:.4f}" + ("" if std is None else f" ± {std:.4f}")


TABLE_HEAD = ("row", "#", "val NLL", "cont. NLL", "Δ val", "seeds", "params", "prefill FLOP/tok",
              "decode FLOP/tok", "decode B/step", "KV B/tok", "train FLOPs")


def table_rows(doc: dict[str, Any]) -> list[tuple[str, ...]]:
    """One tuple of strings per row of the results, in TABLE_HEAD order."""
    ref = doc["rows"].get("baseline", {}).get("summary", {}).get("loss_mean")
    out: list[tuple[str, ...]] = []
    for e in doc["rows"].values():
        s, c = e.get("summary", {}), e["cost"]
        delta = "-" if ref is None or s.get("loss_mean") is None else f"{s['loss_mean'] - ref:+.4f}"
        out.append((e["name"], e["group"], _pm(s, "loss"), _pm(s, "continuation_loss"), delta,
                    str(s.get("n", 0)), compact_si(c["params"]),
                    compact_si(c["prefill_flops_per_token"]),
                    compact_si(c["decode_flops_per_token"]),
                    compact_si(c["decode_bytes_per_step"], "B"),
                    f"{c['kv_bytes_per_token']:,}", compact_si(c["train_flops"])))
    return out


def text_table(doc: dict[str, Any]) -> str:
    """Aligned plain-text table."""
    rows = [TABLE_HEAD, *table_rows(doc)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(TABLE_HEAD))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in rows)


def markdown_table(doc: dict[str, Any]) -> str:
    """The README table."""
    s = doc["settings"]
    lines = [
        f"Validation NLL (nats/token) of the decode-time prediction, `{s['preset']}`, "
        f"{s['steps']} steps of {s['batch_size']}x{s['seq_len']} tokens, mean ± std over seeds; "
        f"costs from `audit.flops` (bf16, batch 1, context {s['context']}).",
        "",
        "| " + " | ".join(TABLE_HEAD) + " |",
        "|" + "---|" * len(TABLE_HEAD),
    ]
    lines += ["| " + " | ".join(r) + " |" for r in table_rows(doc)]
    return "\n".join(lines)
