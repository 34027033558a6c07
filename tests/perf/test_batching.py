"""The FLOP ceiling on continuous batching, from the audit's FLOP model."""

from __future__ import annotations

import pytest

from splitphase.audit.flops import decode_flops, prefill_flops
from splitphase.model.config import ModelConfig
from splitphase.perf.batching import flop_bound_tok_per_s, request_flops


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
