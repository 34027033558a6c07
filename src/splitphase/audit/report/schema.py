"""JSON Schema (draft 2020-12) of report.json, and a validator.

`python -m splitphase.audit.report.schema` prints the schema. Fields named `*_utilization` are
fractions of a hardware peak (0.31 means 31%); times are seconds, rates per second.
"""

from __future__ import annotations

import json
from typing import Any

from splitphase.errors import UserError

_NUM = {"type": "number"}
_NONNEG = {"type": "number", "minimum": 0}
_FRACTION = {"type": "number", "minimum": 0}  # above 1 is possible and flagged in `warnings`
_BOUND = {"enum": ["compute", "memory"]}
_OPT_NUM = {"type": ["number", "null"]}
_STATS = {
    "type": "object",
    "required": ["n", "mean_s", "p50_s", "p90_s", "p99_s"],
    "properties": {k: _NONNEG for k in ("n", "mean_s", "p50_s", "p90_s", "p99_s")},
}
_LEVEL = {
    "type": "object",
    "required": [
        "point", "concurrency", "batch", "flops", "bytes", "seconds", "bound",
        "flops_utilization", "bandwidth_utilization", "tokens_per_s",
        "tokens_per_s_at_full_utilization", "gap",
    ],
    "properties": {
        "point": {"type": "string"},
        "concurrency": {"type": "integer", "minimum": 1},
        "batch": _NONNEG,
        "flops": _NONNEG,
        "bytes": _NONNEG,
        "seconds": {"type": "number", "exclusiveMinimum": 0},
        "bound": _BOUND,
        "flops_utilization": _FRACTION,
        "bandwidth_utilization": _FRACTION,
        "tokens_per_s": _NONNEG,
        "tokens_per_s_at_full_utilization": _NONNEG,
        "gap": {"type": "boolean"},
    },
}


def _phase(extra_required: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": [
            "bound", "intensity_flop_per_byte", "ridge_flop_per_byte", "flops_utilization",
            "bandwidth_utilization", "utilization", "gap", "headline_point", "tokens_per_s",
            "tokens_per_s_at_full_utilization", "levels", *extra_required,
        ],
        "properties": {
            "bound": _BOUND,
            "intensity_flop_per_byte": _NONNEG,
            "ridge_flop_per_byte": _NONNEG,
            "flops_utilization": _FRACTION,
            "bandwidth_utilization": _FRACTION,
            "utilization": _FRACTION,
            "marginal_flops_utilization": _OPT_NUM,
            "gap": {"type": "boolean"},
            "headline_point": {"type": "string"},
            "tokens_per_s": _NONNEG,
            "tokens_per_s_at_full_utilization": _NONNEG,
            "step_s": {"type": "number", "exclusiveMinimum": 0},
            "levels": {"type": "array", "minItems": 1, "items": _LEVEL},
        },
    }


_RATES = {
    "type": "object",
    "required": [
        "prefill_tokens_per_s", "decode_tokens_per_s", "usd_per_million_input_tokens",
        "usd_per_million_output_tokens", "monthly_usd",
    ],
    "properties": {k: _NONNEG for k in (
        "prefill_tokens_per_s", "decode_tokens_per_s", "usd_per_million_input_tokens",
        "usd_per_million_output_tokens", "monthly_usd", "monthly_hours",
    )},
}

REPORT_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "https://splitphase.dev/schemas/audit-report-1.json",
    "title": "splitphase audit report",
    "type": "object",
    "required": [
        "schema_version", "summary", "target", "hardware", "model", "probe", "profile",
        "prefill", "decode", "optimizations", "cost", "warnings",
    ],
    "properties": {
        "schema_version": {"const": "1.0"},
        "splitphase_version": {"type": "string"},
        "generated_at": {"type": "string"},
        "summary": {"type": "array", "minItems": 1, "items": {"type": "string"}},
        "warnings": {"type": "array", "items": {"type": "string"}},
        "target": {
            "type": "object",
            "required": ["kind", "spec", "concurrent_streams"],
            "properties": {
                "kind": {"enum": ["builtin", "hf", "openai"]},
                "spec": {"type": "string"},
                "concurrent_streams": {"type": "boolean"},
                "kv_pool_tokens": {"type": ["integer", "null"], "minimum": 1},
                "preemptions": {"type": ["integer", "null"], "minimum": 0},
                "max_num_seqs": {"type": ["integer", "null"], "minimum": 1},
            },
        },
        "hardware": {
            "type": "object",
            "required": [
                "name", "dtype", "peak_flops_per_s", "mem_bandwidth_bytes_per_s",
                "ridge_flop_per_byte", "price_usd_per_hour", "source",
            ],
            "properties": {
                "name": {"type": "string"},
                "dtype": {"type": "string"},
                "peak_flops_per_s": {"type": "number", "exclusiveMinimum": 0},
                "mem_bandwidth_bytes_per_s": {"type": "number", "exclusiveMinimum": 0},
                "ridge_flop_per_byte": {"type": "number", "exclusiveMinimum": 0},
                "price_usd_per_hour": _NONNEG,
                "source": {"type": "string"},
            },
        },
        "model": {
            "type": "object",
            "required": ["name", "config", "param_count", "kv_bytes_per_token"],
            "properties": {
                "name": {"type": "string"},
                "config": {"type": "object"},
                "param_count": {"type": "integer", "minimum": 1},
                "active_param_count": {"type": "integer", "minimum": 1},
                "kv_dtype_bytes": {"type": "integer", "minimum": 1, "maximum": 4},
                "kv_bytes_per_token": {"type": "integer", "minimum": 0},
                "weight_format": {"type": "string"},
                "weight_bytes_per_param": {"type": "number", "exclusiveMinimum": 0},
                "weight_bytes": {"type": "number", "minimum": 0},
            },
        },
        "probe": {
            "type": "object",
            "required": ["quick", "prompt_lens", "concurrency_levels", "output_tokens"],
            "properties": {
                "quick": {"type": "boolean"},
                "prompt_lens": {"type": "array", "items": {"type": "integer", "minimum": 1}},
                "concurrency_levels": {
                    "type": "array", "items": {"type": "integer", "minimum": 1}
                },
                "output_tokens": {"type": "integer", "minimum": 1},
                "duration_s": _NONNEG,
            },
        },
        "profile": {
            "type": "object",
            "required": ["source", "ttft", "prefill", "itl", "points", "interference"],
            "properties": {
                "source": {"enum": ["client", "server"]},
                "ttft": _STATS,
                "prefill": _STATS,
                "itl": _STATS,
                "ttft_slope_s_per_token": _OPT_NUM,
                "points": {"type": "array", "minItems": 1},
                "interference": {"type": ["object", "null"]},
            },
        },
        "prefill": _phase(["marginal_flops_utilization"]),
        "decode": _phase(["step_s"]),
        "optimizations": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "phase", "evidence", "applicable", "metric", "detail"],
                "properties": {
                    "name": {"type": "string"},
                    "phase": {"enum": ["prefill", "decode"]},
                    "evidence": {"enum": ["measured", "projected"]},
                    "applicable": {"type": "boolean"},
                    "before": _OPT_NUM,
                    "after": _OPT_NUM,
                    "speedup": _OPT_NUM,
                    "detail": {"type": "string"},
                },
            },
        },
        "cost": {
            "type": "object",
            "required": [
                "price_usd_per_hour", "usd_per_million_input_tokens",
                "usd_per_million_output_tokens", "now", "achievable", "workload",
                "monthly_usd", "monthly_usd_achievable", "monthly_savings_usd", "assumptions",
            ],
            "properties": {
                "price_usd_per_hour": _NONNEG,
                "usd_per_million_input_tokens": _NONNEG,
                "usd_per_million_output_tokens": _NONNEG,
                "now": _RATES,
                "achievable": _RATES,
                "monthly_usd": _NONNEG,
                "monthly_usd_achievable": _NONNEG,
                "monthly_savings_usd": _NUM,
                "assumptions": {"type": "array", "minItems": 1, "items": {"type": "string"}},
            },
        },
    },
}


def validate_report(doc: dict[str, Any]) -> None:
    """Raise UserError naming the first field of `doc` that breaks the schema."""
    try:
        import jsonschema
    except ImportError as exc:  # pragma: no cover - a declared dependency
        raise UserError("validating a report needs jsonschema: pip install jsonschema") from exc
    validator = jsonschema.Draft202012Validator(REPORT_SCHEMA)
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.path))
    if errors:
        first = errors[0]
        where = "/".join(str(p) for p in first.path) or "(top level)"
        raise UserError(f"report.json breaks its schema at {where}: {first.message}")


if __name__ == "__main__":
    print(json.dumps(REPORT_SCHEMA, indent=2))
