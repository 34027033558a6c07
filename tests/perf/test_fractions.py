"""Raw timings into fractions of the run's peaks; rounds merged figure by figure."""

from __future__ import annotations

import pytest

from splitphase.audit.flops import dense_linear_shapes
from splitphase.model.config import ModelConfig
from splitphase.perf.fractions import best_of_rounds, derive_fractions
from splitphase.perf.peaks import prefill_gemm_ceiling

TINY = ModelConfig.from_name("tiny")
PEAKS = {"triad_bytes_per_s": 40e9, "matmul_model_shapes_flops_per_s_float32": 100e9,
         **{f"gemm_float32_{o}x{i}_flops_per_s": 70e9 for o, i, _ in dense_linear_shapes(TINY)}}


def _raw() -> dict:
    return {
        "decode_b1": {"batch": 1, "step_s": 0.02, "bytes_per_step": 0.6e9},
        "decode_b8": {"batch": 8, "step_s": 0.04, "bytes_per_step": 0.8e9},
        "decode_overhead_s_b1": 0.001,
        "prefill_512": {"s": 0.5, "flops": 40e9, "tokens": 512},
        "interleaved_prefill_512_gemm": {"prefill_s": 0.45, "gemm_s": 0.01,
                                         "prefill_flops": 40e9, "gemm_flops": 0.9e9},
        "interleaved_b1_triad": {"step_s": 0.018, "triad_pass_s": 0.02,
                                 "triad_bytes_per_pass": 0.8e9, "read_pass_s": 0.015,
                                 "read_bytes_per_pass": 0.8e9},
    }


def test_decode_and_prefill_become_rates_and_fractions_of_the_peaks() -> None:
    raw = _raw()
    out = derive_fractions(raw, PEAKS, "float32", TINY)
    assert out["decode_b8"]["tok_per_s"] == pytest.approx(200.0)
    assert out["decode_b1"]["bandwidth_bytes_per_s"] == pytest.approx(30e9)
    assert out["decode_b1"]["bw_fraction"] == pytest.approx(0.75)
    assert out["prefill_512"]["flops_per_s"] == pytest.approx(80e9)
    assert out["prefill_512"]["flops_fraction"] == pytest.approx(0.8)
    assert out["prefill_512"]["gemm_ceiling_fraction"] == pytest.approx(  # dense models only
        prefill_gemm_ceiling(TINY, PEAKS, "float32", 512))
    assert out["decode_overhead_fraction_b1"] == pytest.approx(0.05)
    # Against the GEMM timed in alternation: (40/0.45) / (0.9/0.01) GFLOP/s.
    assert out["interleaved_prefill_512_gemm"]["flops_fraction"] == pytest.approx(
        40 / 0.45 / 90)
    w = out["interleaved_b1_triad"]  # the step's bytes at its interleaved time, per yardstick
    assert w["bw_fraction"] == pytest.approx(0.6e9 / 0.018 / 40e9)
    assert w["read_fraction"] == pytest.approx(0.6e9 / 0.018 / (0.8e9 / 0.015))
    assert "bw_fraction" not in raw["decode_b1"]  # the raw round is left as it was


def test_rounds_merge_to_the_best_time_or_rate_and_a_reason_gives_way() -> None:
    a = {"t": 2.0, "n": 3, "why": "not installed", "only_a": 1.0, "sub": {"t": 1.0}}
    b = {"t": 1.5, "n": 3, "why": {"t": 4.0}, "sub": {"t": 2.0}}
    merged = best_of_rounds(a, b)
    assert merged == {"t": 1.5, "n": 3, "why": {"t": 4.0}, "only_a": 1.0, "sub": {"t": 1.0}}
    assert best_of_rounds(a, b, larger=True)["t"] == 2.0
    assert best_of_rounds(None, 3.0) == 3.0 and best_of_rounds(3.0, "n/a") == 3.0
