"""CPU calibration: one real quick measurement, then the cache is reused (measurement faked)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from splitphase.hardware import calibrate as cal
from splitphase.hardware.specs import HARDWARE, HardwareSpec


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPLITPHASE_CACHE", str(tmp_path))
    # A real probe can beat a real cached calibration on a machine whose load changes.
    monkeypatch.setattr(cal, "_spot_probe", lambda quick: (1.0, 1.0))
    return tmp_path


def _fake_spec(tag: str) -> HardwareSpec:
    return dataclasses.replace(HARDWARE["l4"], name="cpu", source=tag)


def _no_measuring(*args: object) -> HardwareSpec:
    raise AssertionError("the cache should have been used")


def test_quick_calibration_measures_and_caches(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = cal.calibrate(quick=True)
    assert spec.name == "cpu"
    assert spec.peak_bf16_flops_per_s > 0
    assert spec.peak_fp32_flops_per_s is not None and spec.peak_fp32_flops_per_s > 0
    assert spec.mem_bandwidth_bytes_per_s > 0
    assert spec.mem_capacity_bytes > 0
    assert spec.peak_fp8_flops_per_s is None
    assert spec.price_usd_per_hour == cal.DEFAULT_CPU_PRICE_USD_PER_HOUR
    files = list(cache.glob("calibration-*-quick.json"))
    assert len(files) == 1
    monkeypatch.setattr(cal, "_measure", _no_measuring)
    assert cal.calibrate(quick=True) == spec


def test_spot_probe_measures() -> None:
    bandwidth, fp32 = cal._spot_probe(True)
    assert bandwidth > 1e8 and fp32 > 1e8


def test_a_cache_beaten_by_a_spot_probe_is_remeasured(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loaded = dataclasses.replace(
        _fake_spec("under load"), mem_bandwidth_bytes_per_s=10e9, peak_fp32_flops_per_s=100e9
    )
    monkeypatch.setattr(cal, "_measure", lambda quick, key, price: loaded)
    cal.calibrate(quick=True)
    monkeypatch.setattr(cal, "_measure", lambda quick, key, price: _fake_spec("quiet"))
    monkeypatch.setattr(cal, "_spot_probe", lambda quick: (11e9, 105e9))  # within noise
    assert cal.calibrate(quick=True).source == "under load"
    monkeypatch.setattr(cal, "_spot_probe", lambda quick: (20e9, 105e9))  # bandwidth beaten
    assert cal.calibrate(quick=True).source == "quiet"
    assert cal.calibrate(quick=True).source == "quiet"  # and the new figures are cached


def test_a_beaten_full_calibration_is_dropped(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = dataclasses.replace(_fake_spec("full, under load"), mem_bandwidth_bytes_per_s=10e9)
    monkeypatch.setattr(cal, "_measure", lambda quick, key, price: loaded)
    cal.calibrate(quick=False)
    monkeypatch.setattr(cal, "_measure", lambda quick, key, price: _fake_spec(f"quick={quick}"))
    monkeypatch.setattr(cal, "_spot_probe", lambda quick: (20e9, 1.0))
    assert cal.calibrate(quick=True).source == "quick=True"
    assert not list(cache.glob("calibration-*-full.json"))  # not probed again on every call


def test_refresh_remeasures(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cal, "_measure", lambda quick, key, price: _fake_spec("first"))
    assert cal.calibrate(quick=True).source == "first"
    monkeypatch.setattr(cal, "_measure", lambda quick, key, price: _fake_spec("second"))
    assert cal.calibrate(quick=True).source == "first"  # cached
    assert cal.calibrate(quick=True, refresh=True).source == "second"
    assert cal.calibrate(quick=True).source == "second"


def test_quick_accepts_a_full_calibration_but_not_vice_versa(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cal, "_measure", lambda quick, key, price: _fake_spec(f"quick={quick}"))
    assert cal.calibrate(quick=True).source == "quick=True"
    assert cal.calibrate(quick=False).source == "quick=False"  # a quick cache is not enough
    assert cal.calibrate(quick=True).source == "quick=False"  # the better result wins


def test_corrupt_cache_is_a_miss_and_price_is_the_callers(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cal, "_measure", lambda quick, key, price: _fake_spec("fresh"))
    cal.calibrate(quick=True)
    (path,) = cache.glob("calibration-*.json")
    path.write_text("{not json")
    assert cal.calibrate(quick=True).source == "fresh"
    monkeypatch.setattr(cal, "_measure", _no_measuring)
    assert cal.calibrate(quick=True, price_usd_per_hour=0.5).price_usd_per_hour == 0.5


def test_cache_key_separates_threads_and_versions(cache: Path) -> None:
    key = cal._cache_key()
    assert key["cpu"] == cal.cpu_model_name()
    for other in ({**key, "threads": key["threads"] + 1}, {**key, "cpu_signature": "other"}):
        assert cal._cache_path(key, True) != cal._cache_path(other, True)
    assert cal._cache_path(key, True).parent == cache


def test_packed_products_compute_the_linear_each_packed_gemm_has() -> None:
    import torch

    from splitphase.kernels import packed_linear

    x, w = torch.randn(64, 48), torch.randn(32, 48)
    products = cal._packed_products(x, w)
    assert len(products) == len(packed_linear.backends())  # every backend has fp32
    for product in products:
        torch.testing.assert_close(product(), x @ w.T, atol=1e-4, rtol=1e-4)


def test_gemm_peak_takes_the_fastest_product(monkeypatch: pytest.MonkeyPatch) -> None:
    # A product that costs nothing beats torch's matmul: the peak is the fastest one offered.
    plain = cal.measure_gemm_flops_per_s("float32", max_n=256, repeats=2)
    monkeypatch.setattr(cal, "_packed_products", lambda x, w: [lambda: None])
    assert cal.measure_gemm_flops_per_s("float32", max_n=256, repeats=2) > 100 * plain
