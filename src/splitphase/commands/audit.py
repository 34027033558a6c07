"""`splitphase audit`, `splitphase compare` and `splitphase demo`: probe, five steps, report."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from splitphase.errors import UserError
from splitphase.model.config import ModelConfig
from splitphase.model.config_sources import config_doc, load_model_config

if TYPE_CHECKING:
    from splitphase.audit.weights import WeightFormat
    from splitphase.hardware.specs import HardwareSpec

DEMO_TARGET = "builtin:small"
DEMO_OUT = "splitphase-report"
DEFAULT_REQUESTS_PER_DAY = 100_000.0


def resolve_hardware(name: str | None, target_spec: str, price_usd_per_hour: float | None) -> Any:
    """The hardware spec by name (default `cpu` for in-process targets), with the price set."""
    from splitphase.hardware.specs import HardwareError, get_hardware, list_hardware

    if name is None:
        if target_spec.startswith("openai:"):
            raise UserError(
                "openai: targets need --hardware NAME, the server's accelerator; choose one of: "
                + ", ".join(list_hardware())
            )
        name = "cpu"
    try:
        hw = get_hardware(name)
    except HardwareError as exc:
        raise UserError(str(exc)) from exc
    if price_usd_per_hour is not None:
        if price_usd_per_hour < 0:
            raise UserError(f"--price-per-hour must be >= 0, got {price_usd_per_hour}")
        hw = replace(hw, price_usd_per_hour=price_usd_per_hour)
    return hw


@dataclass(frozen=True)
class AuditOptions:
    """Everything `splitphase audit` takes."""

    target: str
    out: str
    hardware: str | None = None
    price_per_hour: float | None = None
    workload: str | None = None
    model_config: str | None = None
    quick: bool = False
    requests_per_day: float = DEFAULT_REQUESTS_PER_DAY
    bill_prompt_tokens: float | None = None
    bill_output_tokens: float | None = None
    progress: bool = True
    kv_cache_dtype: str = "auto"  # the target's K/V cache (EngineConfig.kv_cache_dtype's names)
    quantization: str = "auto"  # its weights: auto (as it states), none, or audit.weights' names


def _plan(opts: AuditOptions, max_len: int) -> Any:
    from splitphase.audit.probes import load_workload, plan_for

    plan = plan_for(max_len, opts.quick)
    if opts.workload:
        pairs = load_workload(opts.workload, max_len, opts.quick)
        plan = replace(plan, workload=pairs, workload_file=str(opts.workload))
    return plan


def _bill(opts: AuditOptions, plan: Any) -> Any:
    from splitphase.audit.steps import Workload

    if plan.workload:
        prompt = statistics.fmean(p for p, _ in plan.workload)
        output = statistics.fmean(o for _, o in plan.workload)
    else:
        prompt, output = max(plan.prompt_lens), plan.output_tokens
    return Workload(
        opts.requests_per_day,
        opts.bill_prompt_tokens if opts.bill_prompt_tokens is not None else prompt,
        opts.bill_output_tokens if opts.bill_output_tokens is not None else output,
    )


def _context_len(target: Any, cfg: ModelConfig | None) -> int:
    served = target.describe().get("max_model_len")
    if cfg is not None:
        return min(cfg.max_seq_len, served or cfg.max_seq_len)
    return int(served or 1024)


def run_audit(opts: AuditOptions) -> tuple[dict[str, Any], Path]:
    """Probe the target, run the five steps, write the report; (report.json doc, out dir)."""
    from splitphase.audit.probes import run_probe
    from splitphase.audit.report import build_report, write_report
    from splitphase.audit.steps import ServingLimits, run_steps
    from splitphase.audit.targets import open_target

    override = load_model_config(opts.model_config) if opts.model_config else None
    hw = resolve_hardware(opts.hardware, opts.target, opts.price_per_hour)
    if opts.quantization not in ("auto", "none") and not opts.target.startswith("openai:"):
        raise UserError("--quantization describes an openai: target's weights; builtin and hf: "
                        "targets run their weights in the model's dtype")
    target = open_target(opts.target, override, opts.kv_cache_dtype)
    try:
        cfg = target.model_config()
        plan = _plan(opts, _context_len(target, cfg))
        probe = run_probe(target, plan, _context_len(target, cfg), progress=opts.progress)
        described = target.describe()
    finally:
        target.close()
    described, kv_b = _kv_cache(opts, described, cfg)
    described, weights = _weights(opts, described, cfg, hw)
    policies = _compare_policies(opts, described, plan, probe.traces, _context_len(target, cfg))
    limits = ServingLimits(described.get("kv_pool_tokens"), described.get("max_num_seqs"))
    result = run_steps(probe.traces, cfg, hw, hw.price_usd_per_hour, _bill(opts, plan),
                       policies, described.get("policy"), kv_b, limits, weights)
    doc = build_report(result, described, hw, cfg, probe)
    out = write_report(opts.out, doc, result.profile.itl_samples_s)
    return doc, out


def _kv_cache(
    opts: AuditOptions, described: dict[str, Any], cfg: ModelConfig
) -> tuple[dict[str, Any], int]:
    """The K/V cache dtype the audit prices decode at (the option, else what the target states,
    else the model's), recorded in the target's description with where it came from."""
    from splitphase.engine.config import KV_CACHE_DTYPE_BYTES, kv_cache_dtype_bytes

    stated = described.get("kv_cache_dtype")
    if opts.kv_cache_dtype != "auto":
        name, source = opts.kv_cache_dtype, "option"
        if stated not in (None, "auto", name) and opts.progress:
            print(f"the target states K/V cache dtype {stated!r}; pricing decode at "
                  f"--kv-cache-dtype {name!r}")
    elif stated in KV_CACHE_DTYPE_BYTES or stated == "auto":
        name, source = stated, "target"
    else:
        if stated is not None and opts.progress:
            print(f"the target states K/V cache dtype {stated!r}, which the audit cannot price; "
                  f"assuming the model's {cfg.dtype} (pass --kv-cache-dtype)")
        name, source = "auto", "model"
    kv_b = kv_cache_dtype_bytes(name, cfg.dtype_bytes)
    return {**described, "kv_cache_dtype": name, "kv_cache_dtype_source": source}, kv_b


def _weights(
    opts: AuditOptions, described: dict[str, Any], cfg: ModelConfig, hw: HardwareSpec
) -> tuple[dict[str, Any], WeightFormat]:
    """How the target stores its weights (the option, else what --model-config's config.json
    states, else what the target states, else unquantized in the model's dtype), recorded in
    its description with where that came from."""
    from splitphase.audit.weights import quantization_in_config, weight_format

    path = opts.model_config if opts.target.startswith("openai:") else None
    doc = config_doc(Path(path).expanduser()) if path else None
    in_file = quantization_in_config(doc) if doc is not None else None
    if opts.quantization != "auto":
        name, source = (None if opts.quantization == "none" else opts.quantization), "option"
    elif in_file is not None:
        name, source = in_file, "model-config"
    else:
        stated = described.get("quantization")
        name, source = stated, ("target" if stated else "model")
    fmt = weight_format(name, cfg.dtype, has_peak=hw.has_peak)
    return {**described, "quantization": fmt.name if fmt.quantized else None,
            "quantization_source": source}, fmt


def _compare_policies(
    opts: AuditOptions, described: dict[str, Any], plan: Any, traces: Any, max_len: int
) -> list[Any]:
    """Our engine in-process: the interference probe again under each batching policy."""
    if described.get("kind") != "builtin" or not described.get("concurrent_streams"):
        return []
    from splitphase.audit.policies import compare_policies

    if opts.progress:
        print("comparing batching policies (mixed, chunked, disaggregated) on the same probe")
    return compare_policies(described["model"], plan, traces, max_len,
                            kv_cache_dtype=opts.kv_cache_dtype)


def audit(opts: AuditOptions) -> None:
    """`splitphase audit`: print where the report went and its plain-language summary."""
    doc, out = run_audit(opts)
    print(f"report: {out / 'report.html'} (also report.json, report.md)")
    for line in doc["summary"]:
        print(f"  - {line}")


def compare(
    targets: list[str], model_config: str | None, quick: bool, out: str | None,
    progress: bool = True,
) -> None:
    """`splitphase compare`: the same probe on every target, one table and one plot."""
    from splitphase.audit import compare as cmp
    from splitphase.audit.probes import plan_for, run_probe
    from splitphase.audit.steps import profile
    from splitphase.audit.targets import open_target

    if len(targets) < 2:
        raise UserError("compare needs at least two targets, e.g. openai:URL1 openai:URL2")
    cfg = load_model_config(model_config) if model_config else None
    opened = [open_target(spec, cfg) for spec in targets]
    try:
        max_len = min(_context_len(t, cfg) for t in opened)
        plan = plan_for(max_len, quick)
        speeds = [
            cmp.phase_speeds(spec, profile(run_probe(t, plan, max_len, progress).traces),
                             cmp.kv_cache_of(t.describe()), cmp.weights_of(t.describe()))
            for spec, t in zip(targets, opened, strict=True)
        ]
    finally:
        for t in opened:
            t.close()
    _print_compare(speeds)
    if out:
        _write_compare(Path(out), speeds)


def _print_compare(speeds: list[Any]) -> None:
    from splitphase.audit.compare import TABLE_HEADER, table_rows, verdicts

    rows = [TABLE_HEADER, *table_rows(speeds)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(TABLE_HEADER))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))
    for line in verdicts(speeds):
        print(line)


def _write_compare(out: Path, speeds: list[Any]) -> None:
    from html import escape

    from splitphase.audit.compare import TABLE_HEADER, compare_doc, compare_plot, table_rows
    from splitphase.audit.report.html import CSS, table_html
    from splitphase.audit.report.markdown import table_md

    doc = compare_doc(speeds)
    rows = table_rows(speeds)
    verdict = "".join(f"<li>{escape(v)}</li>" for v in doc["verdicts"])
    page = (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>splitphase compare'
        f"</title><style>{CSS}</style></head><body><main><header><h1>splitphase compare</h1>"
        f'</header><div class="summary"><ul>{verdict}</ul></div><section>'
        f"{table_html(TABLE_HEADER, rows)}<figure><img alt=\"phase by phase\" "
        f'src="data:image/png;base64,{compare_plot(speeds)}"></figure></section></main></body></html>'
    )
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "compare.json").write_text(json.dumps(doc, indent=2) + "\n")
        (out / "compare.html").write_text(page, encoding="utf-8")
        (out / "compare.md").write_text(
            "# splitphase compare\n\n" + "".join(f"- {v}\n" for v in doc["verdicts"]) + "\n"
            + table_md(TABLE_HEADER, rows)
        )
    except OSError as exc:
        raise UserError(f"cannot write the comparison to {out}: {exc.strerror or exc}") from exc
    print(f"comparison: {out / 'compare.html'} (also compare.json, compare.md)")


def demo() -> None:
    """`splitphase demo`: quick audit of the embedded model on this CPU into ./splitphase-report."""
    print(f"splitphase demo: auditing {DEMO_TARGET} on this CPU\n")
    audit(AuditOptions(target=DEMO_TARGET, out=DEMO_OUT, hardware="cpu", quick=False))
