"""The plain-language summary at the top of every report, written from the report's numbers."""

from __future__ import annotations

from typing import Any

from splitphase.audit.report import fmt

GAP = 0.5


def _pct(x: float) -> str:
    return f"{x:.0%}" if x >= 0.01 else f"{x:.2%}"


def _verdict(phase: dict[str, Any], unit: str) -> str:
    if phase["utilization"] < GAP:
        full = fmt.rate(phase["tokens_per_s_at_full_utilization"])
        return f": the gap software can recover (up to {full} {unit} at full use)"
    return ": close to what the hardware allows"


def _prefill_line(doc: dict[str, Any]) -> str:
    pre, hw = doc["prefill"], doc["hardware"]
    line = (
        f"prefill uses {_pct(pre['flops_utilization'])} of {hw['name']}'s peak {hw['dtype']} "
        f"FLOP/s ({pre['bound']}-bound, {pre['tokens_per_s']:,.0f} prompt tokens/s at "
        f"{pre['headline_point']})"
    )
    return line + _verdict(pre, "tokens/s")


def _decode_line(doc: dict[str, Any]) -> str:
    dec = doc["decode"]
    if dec["bound"] == "memory":
        used, resource = dec["bandwidth_utilization"], "memory bandwidth"
    else:
        used, resource = dec["flops_utilization"], "peak FLOP/s"
    line = (
        f"decode uses {_pct(used)} of {resource} ({dec['bound']}-bound, "
        f"{fmt.rate(dec['tokens_per_s'])} tokens/s over {_streams(dec)})"
    )
    return line + _verdict(dec, "tokens/s")


def _streams(phase: dict[str, Any]) -> str:
    head = next(lv for lv in phase["levels"] if lv["point"] == phase["headline_point"])
    batch = f"{head['batch']:.0f}"
    return f"{batch} stream" + ("" if batch == "1" else "s")


def _best_optimization(doc: dict[str, Any]) -> str | None:
    useful = [o for o in doc["optimizations"] if o["applicable"] and (o["speedup"] or 0) > 1.05]
    if not useful:
        return None
    best = max(useful, key=lambda o: o["speedup"])
    return (
        f"biggest win: {best['name']} ({best['evidence']}), {best['speedup']:.1f}x better "
        f"{best['metric']}"
    )


def _cost_line(doc: dict[str, Any]) -> str:
    c = doc["cost"]
    line = (
        f"output tokens cost {fmt.money(c['usd_per_million_output_tokens'])} per million and input "
        f"tokens {fmt.money(c['usd_per_million_input_tokens'])} now; at achievable utilization "
        f"{fmt.money(c['achievable']['usd_per_million_output_tokens'])} and "
        f"{fmt.money(c['achievable']['usd_per_million_input_tokens'])}"
    )
    if c["monthly_savings_usd"] > 0:
        line += (
            f", taking the stated workload's bill from {fmt.money(c['monthly_usd'])} to "
            f"{fmt.money(c['monthly_usd_achievable'])} a month ({c['savings_fraction']:.0%} less)"
        )
    return line


def summary_lines(doc: dict[str, Any]) -> list[str]:
    """Sentences, most important first: each phase's use of the hardware, the fix, the money."""
    lines = [_decode_line(doc), _prefill_line(doc)]
    inter = doc["profile"]["interference"]
    if inter:
        lines.append(
            f"a long prompt slows running streams {inter['spike']:.1f}x while it is prefilled "
            f"(measured: {inter['baseline_itl_s'] * 1e3:.1f} ms -> "
            f"{inter['during_prefill_itl_s'] * 1e3:.1f} ms per token)"
        )
    best = _best_optimization(doc)
    if best:
        lines.append(best)
    lines.append(_cost_line(doc))
    return [line[0].upper() + line[1:] + "." for line in lines] + doc.get("warnings", [])


def _priced_larger(doc: dict[str, Any]) -> str:
    """How the audit may have priced more work than the server does: the geometry it was given
    or took from a name, or weights the server stores narrower than the audit knows."""
    target = doc["target"]
    source = target.get("model_config_source") or ""
    geometry = (f"the geometry taken from the {source} is" if source.startswith("served")
                else "--model-config is")
    quantizes = (target.get("kind") == "openai" and not target.get("quantization")
                 and target.get("quantization_source") != "option")
    return (f"{geometry} larger than the served model"
            + (", or the server quantizes its weights (pass --quantization)" if quantizes else ""))


def warnings_for(doc: dict[str, Any]) -> list[str]:
    """Signs that a figure cannot be trusted, such as utilization above 100%."""
    out = []
    for phase in ("prefill", "decode"):
        for lv in doc[phase]["levels"]:
            if max(lv["flops_utilization"], lv["bandwidth_utilization"]) > 1.0:
                out.append(
                    f"Warning: {phase} at {lv['point']} measures above 100% of "
                    f"{doc['hardware']['name']}'s peak, so the peak is too low (a calibration "
                    f"taken under load, or the wrong --hardware) or {_priced_larger(doc)}."
                )
                break
    preempted = doc["target"].get("preemptions")
    if preempted:
        out.append(
            f"Warning: the target preempted requests {preempted} "
            f"time{'' if preempted == 1 else 's'} during the probe: its "
            "K/V pool ran out, so those requests computed their tokens again and the latencies "
            "include it; give it a larger pool or audit at a lower concurrency."
        )
    return out
