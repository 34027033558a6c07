"""Roofline math on synthetic numbers, and phase classification on every GPU in the table."""

from __future__ import annotations

import math

import pytest

from splitphase.audit import flops as fl
from splitphase.audit import roofline as rl
from splitphase.hardware.specs import HARDWARE, get_hardware
from splitphase.model.config import ModelConfig

LLAMA8B = ModelConfig.from_name("llama-3.1-8b")
H100 = get_hardware("h100-sxm")


def test_ridge_point_and_attainable() -> None:
    ridge = rl.ridge_point(H100)
    assert ridge == pytest.approx(989e12 / 3.35e12)
    assert rl.attainable_flops_per_s(10.0, H100) == pytest.approx(10.0 * 3.35e12)
    assert rl.attainable_flops_per_s(10 * ridge, H100) == 989e12
    assert rl.ridge_point(H100, "fp8") == pytest.approx(2 * ridge, rel=1e-3)


def test_classify_at_and_around_the_ridge() -> None:
    ridge = rl.ridge_point(H100)
    assert rl.classify(ridge, H100) == "compute"
    assert rl.classify(ridge * 0.999, H100) == "memory"
    assert rl.classify(0.0, H100) == "memory"


@pytest.mark.parametrize("name", sorted(HARDWARE))
def test_decode_is_memory_bound_and_prefill_compute_bound(name: str) -> None:
    hw = HARDWARE[name]
    decode = fl.decode_cost(LLAMA8B, [1024])
    prefill = fl.prefill_cost(LLAMA8B, 2048)
    assert rl.classify(decode.intensity, hw) == "memory"
    assert rl.classify(prefill.intensity, hw) == "compute"


def test_utilization_on_known_numbers() -> None:
    assert rl.flops_utilization(1e12, 2.0, 1e12) == pytest.approx(0.5)
    assert rl.bandwidth_utilization(3e9, 1.5, 4e9) == pytest.approx(0.5)
    assert rl.flops_utilization(0.0, 1.0, 1e12) == 0.0
    # A decode step moving all of llama-8b's bf16 weights in 5.5 ms on an H100 is ~80% MBU.
    step_bytes = fl.decode_bytes(LLAMA8B, [0])
    mbu = rl.bandwidth_utilization(step_bytes, 5.5e-3, H100.mem_bandwidth_bytes_per_s)
    assert mbu == pytest.approx(step_bytes / 5.5e-3 / 3.35e12)
    assert 0.75 < mbu < 0.85


def test_roofline_time_is_the_slower_roof() -> None:
    assert rl.roofline_time_s(989e12, 0.0, H100) == pytest.approx(1.0)
    assert rl.roofline_time_s(1.0, 3.35e12, H100) == pytest.approx(1.0)
    assert rl.roofline_time_s(989e12, 6.7e12, H100) == pytest.approx(2.0)


@pytest.mark.parametrize("seconds", [0.0, -1.0, math.nan, math.inf])
def test_utilization_rejects_bad_seconds(seconds: float) -> None:
    with pytest.raises(rl.RooflineError, match="seconds"):
        rl.flops_utilization(1.0, seconds, 1e12)
    with pytest.raises(ValueError, match="seconds"):
        rl.bandwidth_utilization(1.0, seconds, 1e9)


def test_utilization_rejects_bad_peaks_and_counts() -> None:
    with pytest.raises(rl.RooflineError, match="peak_flops_per_s"):
        rl.flops_utilization(1.0, 1.0, 0.0)
    with pytest.raises(rl.RooflineError, match="bytes"):
        rl.bandwidth_utilization(-1.0, 1.0, 1e9)
    with pytest.raises(rl.RooflineError, match="intensity"):
        rl.classify(-1.0, H100)
