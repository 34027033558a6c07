"""Continuous batching's figures, and the FLOP ceiling on them from the audit's FLOP model."""

from __future__ import annotations

import pytest

from splitphase.audit.flops import decode_flops, prefill_flops
from splitphase.engine.llm_engine import StepRecord
from splitphase.model.config import ModelConfig
from splitphase.model.transformer import Transformer
from splitphase.perf.batching import (
    engine_rates,
    figures,
    flop_bound_tok_per_s,
    phase_rates,
    request_flops,
)


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


def _step(prefill_tokens: int, decode_seqs: int, wall_s: float) -> StepRecord:
    return StepRecord(0, "x", prefill_tokens, decode_seqs, wall_s, 0.0, 0.0)


def test_phase_rates_count_mixed_steps_as_prefill_and_skip_empty_ones() -> None:
    steps = [_step(100, 0, 0.5), _step(28, 4, 0.1), _step(0, 8, 0.2), _step(0, 8, 0.2),
             _step(0, 0, 0.3)]
    rates = phase_rates(steps)
    assert rates["prefill_tok_per_s"] == pytest.approx(128 / 0.6)
    assert rates["decode_tok_per_s"] == pytest.approx(16 / 0.4)
    assert phase_rates([_step(0, 1, 0.1)]) == {"decode_tok_per_s": pytest.approx(10.0)}


def test_figures_split_the_concurrent_run_into_its_phases() -> None:
    cfg = ModelConfig.from_name("base-125m")
    measured = {"dtype": "float32", "prompt_len": 64, "output_len": 65,
                "engine_tok_per_s_1": 50.0, "engine_tok_per_s_concurrent": 275.0,
                "engine_decode_tok_per_s_1": 60.0, "engine_decode_tok_per_s_concurrent": 480.0,
                "engine_prefill_tok_per_s_concurrent": 1024.0}
    out = figures(measured, {}, cfg, 32)
    assert out["decode_batching_speedup"] == pytest.approx(8.0)
    prefill_s, decode_s = 32 * 64 / 1024.0, 32 * 64 / 480.0  # 2 s, 4.27 s
    assert out["prefill_time_fraction_concurrent"] == pytest.approx(
        prefill_s / (prefill_s + decode_s))
    assert "decode_batching_speedup" not in figures(
        {k: v for k, v in measured.items() if "decode" not in k}, {}, cfg, 32)


def test_engine_rates_time_one_run_and_its_phases() -> None:
    model = Transformer(ModelConfig.from_name("tiny")).eval()
    rates = engine_rates(model, 3, 5, 4)
    assert set(rates) == {"tok_per_s", "prefill_tok_per_s", "decode_tok_per_s"}
    assert all(v > 0 for v in rates.values())
