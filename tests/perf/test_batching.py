"""Continuous batching's figures, and the FLOP ceiling on them from the audit's FLOP model."""

from __future__ import annotations

import pytest

from splitphase.audit.flops import decode_flops, prefill_flops
from splitphase.model.config import ModelConfig
from splitphase.perf.batching import figures, flop_bound_tok_per_s, request_flops


def test_request_flops_is_the_prefill_then_one_decode_step_per_further_token() -> None:
    cfg = ModelConfig.from_name("tiny")
    expected = prefill_flops(cfg, 5) + decode_flops(cfg, [6]) + decode_flops(cfg, [7])
    assert request_flops(cfg, 5, 3) == pytest.approx(expected)
    assert request_flops(cfg, 5, 1) == pytest.approx(prefill_flops(cfg, 5))


def test_flop_bound_is_output_tokens_over_the_time_at_peak() -> None:
    cfg = ModelConfig.from_name("base-125m")
    per_request = request_flops(cfg, 64, 64)
    assert per_request == pytest.approx(29.8e9, rel=0.01)  # the README's figure
    bound = flop_bound_tok_per_s(cfg, 32, 64, 64, 179e9)
    assert bound == pytest.approx(32 * 64 / (32 * per_request / 179e9))
    # One request and 32 at once share the ceiling per request: batching changes the rate,
    # not the FLOPs a request needs.
    assert flop_bound_tok_per_s(cfg, 1, 64, 64, 179e9) == pytest.approx(bound)


def test_figures_add_the_speedup_and_the_ceiling_only_where_the_peak_has_the_engines_dtype(
) -> None:
    cfg = ModelConfig.from_name("base-125m")
    measured = {"dtype": "float32", "prompt_len": 64, "output_len": 64,
                "engine_tok_per_s_1": 50.0, "engine_tok_per_s_concurrent": 275.0}
    out = figures(measured, {"matmul_model_shapes_flops_per_s_float32": 179e9}, cfg, 32)
    assert out["continuous_batching_speedup"] == pytest.approx(5.5)
    bound = flop_bound_tok_per_s(cfg, 32, 64, 64, 179e9)
    assert out["flop_bound_tok_per_s_concurrent"] == pytest.approx(bound)
    assert out["flop_bound_speedup"] == pytest.approx(bound / 50.0)
    assert out["concurrent_peak_fraction"] == pytest.approx(275.0 / bound)
    bf16_only = figures(measured, {"matmul_model_shapes_flops_per_s_bfloat16": 400e9}, cfg, 32)
    assert "flop_bound_speedup" not in bf16_only
    assert bf16_only["continuous_batching_speedup"] == pytest.approx(5.5)
