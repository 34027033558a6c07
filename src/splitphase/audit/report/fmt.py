"""Number formatting shared by the HTML and Markdown reports."""

from __future__ import annotations

import math
from typing import Any


def seconds(x: float | None) -> str:
    """12.3 ms, 1.20 s, 45 us."""
    if x is None:
        return "-"
    if abs(x) >= 1:
        return f"{x:.2f} s"
    if abs(x) >= 1e-3:
        return f"{x * 1e3:.1f} ms"
    return f"{x * 1e6:.0f} us"


def ttft_slope(slope_s: float | None, r2: float | None) -> str:
    """The profile's TTFT-vs-prompt-length fit as a sentence ("" when there was no fit)."""
    if slope_s is None:
        return ""
    fit = "" if r2 is None else f", r² {r2:.2f}"
    if slope_s > 0:
        return f"TTFT grows {seconds(slope_s)} per prompt token{fit}. "
    # A flat or falling fit is noise over prompts too short for prefill to dominate TTFT.
    return (f"TTFT does not grow with the prompt at these lengths (fitted slope "
            f"{seconds(slope_s)} per token{fit}): queueing and per-step overhead dominate it. ")


def pct(x: float | None) -> str:
    """A fraction as a percentage: 0.31 -> 31%."""
    if x is None:
        return "-"
    return f"{x:.1%}" if x < 0.1 else f"{x:.0%}"


def si(x: float | None, unit: str) -> str:
    """1.2 TFLOP/s, 340 GB/s."""
    if x is None:
        return "-"
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def rate(x: float | None) -> str:
    """A rate with thousands separators, decimals only when small."""
    return "-" if x is None else (f"{x:,.0f}" if x >= 100 else f"{x:,.1f}")


def money(x: float | None) -> str:
    """Dollars: cents from $1 up, three significant digits below ($0.0186, $0.00556, $0.100),
    so cheap amounts a table sets side by side keep the precision that tells them apart."""
    if x is None:
        return "-"
    sign, x = ("-" if x < 0 else ""), abs(x)
    if x >= 1 or x == 0:
        return f"{sign}${x:,.2f}"
    return f"{sign}${x:.{max(2, 2 - math.floor(math.log10(x)))}f}"


def metric_value(value: float | None, unit: str) -> str:
    """An optimization's before/after in its own unit."""
    if unit == "s":
        return seconds(value)
    return "-" if value is None else f"{rate(value)} {unit}"


def speedup(x: float | None) -> str:
    """A ratio as 2.50x."""
    return "-" if x is None else f"{x:.2f}x"


def level_rows(doc: dict[str, Any], phase: str) -> list[list[str]]:
    """Table rows of one phase's utilization per probe point."""
    rows = []
    for lv in doc[phase]["levels"]:
        rows.append([
            lv["point"], f"{lv['batch']:.0f}", f"{lv['intensity_flop_per_byte']:.3g}",
            lv["bound"], seconds(lv["seconds"]), si(lv["achieved_flops_per_s"], "FLOP/s"),
            pct(lv["flops_utilization"]), pct(lv["bandwidth_utilization"]),
            rate(lv["tokens_per_s"]), rate(lv["tokens_per_s_at_full_utilization"]),
        ])
    return rows


def level_header(phase: str) -> list[str]:
    """The header of level_rows: prefill's time is the point's prefill busy time (all its
    prompts), decode's is one step."""
    time = "prefill busy" if phase == "prefill" else "step time"
    return ["point", "batch", "FLOP/byte", "bound", time, "achieved", "FLOP util",
            "bandwidth util", "tokens/s", "tokens/s at full"]


def element_bytes(width: int) -> str:
    """"1 byte/element", "2 bytes/element"."""
    return f"{width} byte{'s' if width > 1 else ''}/element"


def cache_and_limits(doc: dict[str, Any]) -> str:
    """", K/V cache fp8 (1 byte/element), pool 81,920 tokens, at most 256 sequences": the width
    decode bytes were priced at ("" if unknown), and the pool's size and the limit on
    sequences at once where the target states them."""
    width = doc["model"].get("kv_dtype_bytes")
    if width is None:
        return ""
    name = doc["target"].get("kv_cache_dtype")
    if name in (None, "auto"):
        name = doc["model"]["config"].get("dtype", "model dtype")
    pool, seqs = doc["target"].get("kv_pool_tokens"), doc["target"].get("max_num_seqs")
    held = (f", pool {pool:,} tokens" if pool else "") + (
        f", at most {seqs} sequences" if seqs else "")
    return f", K/V cache {name} ({element_bytes(width)}){held}"


def model_details(doc: dict[str, Any]) -> str:
    """The header's words on the model: its size, where its geometry came from when the audit
    took the preset from a server's model name (so a reader can check it), its weights when
    quantized, its K/V cache."""
    model, source = doc["model"], doc["target"].get("model_config_source")
    named = f", geometry from the {source}" if source and source.startswith("served") else ""
    quantized = doc["target"].get("quantization")
    per = model["weight_bytes_per_param"]
    weights = f", weights {quantized} ({per:.3g} byte{'' if per == 1 else 's'} each)"
    weights = weights if quantized else ""
    return f"{model['param_count']:,} parameters{named}{weights}{cache_and_limits(doc)}"
