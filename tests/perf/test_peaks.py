"""The prefill ceiling that the model's own GEMM shapes allow."""

from __future__ import annotations

import pytest

from splitphase.audit.flops import CostError, dense_linear_shapes, prefill_flops
from splitphase.model.config import ModelConfig
from splitphase.perf.peaks import prefill_gemm_ceiling

CFG = ModelConfig.from_name("tiny")
PEAK = 100e9


def _peaks(rate_of) -> dict[str, float]:
    rates = {f"gemm_float32_{o}x{i}_flops_per_s": rate_of(o, i)
             for o, i, _ in dense_linear_shapes(CFG)}
    return {"matmul_model_shapes_flops_per_s_float32": PEAK, **rates}


def test_every_shape_at_the_peak_allows_the_whole_peak():
    assert prefill_gemm_ceiling(CFG, _peaks(lambda o, i: PEAK), "float32", 64) == pytest.approx(1)


def test_slower_shapes_lower_the_ceiling_by_their_share_of_the_flops():
    n = 64
    half = prefill_gemm_ceiling(CFG, _peaks(lambda o, i: PEAK / 2), "float32", n)
    linear = sum(2 * n * o * i * c * CFG.n_layers for o, i, c in dense_linear_shapes(CFG))
    total = prefill_flops(CFG, n)
    assert half == pytest.approx(total / (2 * linear + (total - linear)))
    assert 0.5 < half < 1
    # Only the down projection slow: the ceiling sits between the two.
    one = prefill_gemm_ceiling(
        CFG, _peaks(lambda o, i: PEAK / 2 if i == CFG.d_ff else PEAK), "float32", n)
    assert half < one < 1


def test_the_shapes_cover_every_dense_linear_and_refuse_moe():
    n = 8
    linear = sum(2 * n * o * i * c * CFG.n_layers for o, i, c in dense_linear_shapes(CFG))
    head = 2 * CFG.d_model * CFG.vocab_size  # one logits position
    attention = prefill_flops(CFG, n) - linear - head
    assert attention == 4 * CFG.q_dim * CFG.n_layers * n * (n + 1) // 2
    with pytest.raises(CostError, match="dense"):
        dense_linear_shapes(ModelConfig.from_name("tiny-moe"))
