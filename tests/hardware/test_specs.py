"""The hardware table: required entries, dense datasheet figures, lookups and errors."""

from __future__ import annotations

import dataclasses

import pytest

from splitphase.hardware import calibrate as cal
from splitphase.hardware import specs
from splitphase.hardware.specs import HARDWARE, HardwareError, HardwareSpec, get_hardware

REQUIRED = ("h200", "h100-sxm", "h100-pcie", "a100-80gb", "l4", "l40s", "mi300x", "b200")


def test_required_entries_exist_with_sources_and_prices() -> None:
    for name in REQUIRED:
        hw = HARDWARE[name]
        assert hw.name == name
        assert hw.source
        assert hw.price_usd_per_hour > 0
        assert hw.peak_fp32_flops_per_s is not None
        assert hw.peak_fp32_flops_per_s < hw.peak_bf16_flops_per_s


@pytest.mark.parametrize(
    ("name", "bf16_tflops", "bandwidth_tb_s", "capacity_gb"),
    [
        ("h100-sxm", 989, 3.35, 80),
        ("h200", 989, 4.8, 141),
        ("a100-80gb", 312, 2.039, 80),
        ("h100-pcie", 756, 2.0, 80),
        ("l4", 121, 0.3, 24),
        ("l40s", 362, 0.864, 48),
        ("mi300x", 1307.4, 5.3, 192),
        ("b200", 2250, 8.0, 180),
    ],
)
def test_dense_datasheet_figures(
    name: str, bf16_tflops: float, bandwidth_tb_s: float, capacity_gb: float
) -> None:
    hw = get_hardware(name)
    assert hw.peak_bf16_flops_per_s == pytest.approx(bf16_tflops * 1e12)
    assert hw.mem_bandwidth_bytes_per_s == pytest.approx(bandwidth_tb_s * 1e12)
    assert hw.mem_capacity_bytes == pytest.approx(capacity_gb * 1e9)


def test_fp8_is_twice_bf16_where_supported() -> None:
    for hw in HARDWARE.values():
        if hw.peak_fp8_flops_per_s is not None:
            # 3%: the L40S datasheet prints 362.05 bf16 but 733 fp8 (its own rounding).
            ratio = hw.peak_fp8_flops_per_s / hw.peak_bf16_flops_per_s
            assert ratio == pytest.approx(2, rel=0.03)
    assert HARDWARE["a100-80gb"].peak_fp8_flops_per_s is None


def test_int8_is_the_fp8_rate_on_hopper_and_ada_and_ampere_has_int8_only() -> None:
    for name in ("h200", "h100-sxm", "h100-pcie", "l4", "l40s", "mi300x", "b200"):
        hw = HARDWARE[name]
        assert hw.peak_flops_per_s("int8") == hw.peak_fp8_flops_per_s, name
    a100 = HARDWARE["a100-80gb"]
    assert a100.peak_flops_per_s("int8") == pytest.approx(2 * a100.peak_bf16_flops_per_s)
    assert a100.has_peak("int8") and not a100.has_peak("float8") and not a100.has_peak("int4")


def test_peak_by_dtype() -> None:
    hw = get_hardware("h100-sxm")
    assert hw.peak_flops_per_s() == hw.peak_bf16_flops_per_s
    assert hw.peak_flops_per_s("float16") == hw.peak_bf16_flops_per_s
    assert hw.peak_flops_per_s("fp8") == 1979e12
    assert hw.peak_flops_per_s("float32") == 67e12
    with pytest.raises(HardwareError, match="no fp8"):
        get_hardware("a100-80gb").peak_flops_per_s("fp8")
    with pytest.raises(HardwareError, match="unknown dtype"):
        hw.peak_flops_per_s("int3")


def test_lookup_is_forgiving_about_case_and_aliases() -> None:
    assert get_hardware(" H100-SXM ") is HARDWARE["h100-sxm"]
    assert get_hardware("h100") is HARDWARE["h100-sxm"]
    assert get_hardware("a100") is HARDWARE["a100-80gb"]


@pytest.mark.parametrize(("reported", "table"), [
    ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 PCIe", "h100-pcie"),
    ("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-80GB", "a100-80gb"), ("NVIDIA L40S", "l40s"),
    ("NVIDIA L4", "l4"), ("AMD Instinct MI300X", "mi300x"), ("NVIDIA GeForce RTX 4090", None),
])
def test_a_gpu_is_found_by_the_name_its_driver_reports(reported: str, table: str | None) -> None:
    assert specs.hardware_for_gpu(reported) == table


def test_unknown_name_lists_valid_names() -> None:
    with pytest.raises(HardwareError) as info:
        get_hardware("tpu-v9")
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert "tpu-v9" in message
    for name in (*REQUIRED, "cpu"):
        assert name in message
    assert specs.list_hardware()[-1] == "cpu"


def test_cpu_resolves_through_calibrate(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = dataclasses.replace(HARDWARE["l4"], name="cpu", source="fake calibration")
    calls: list[bool] = []

    def fake_calibrate(quick: bool = False, refresh: bool = False) -> HardwareSpec:
        calls.append(quick)
        return fake

    monkeypatch.setattr(cal, "calibrate", fake_calibrate)
    assert get_hardware("cpu") is fake
    assert calls == [True]


def test_table_is_read_only_and_specs_validate() -> None:
    with pytest.raises(TypeError):
        HARDWARE["fake"] = HARDWARE["l4"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        HARDWARE["l4"].price_usd_per_hour = 0.0
    with pytest.raises(HardwareError, match="mem_bandwidth"):
        dataclasses.replace(HARDWARE["l4"], mem_bandwidth_bytes_per_s=0.0)
    with pytest.raises(HardwareError, match="peak_fp8"):
        dataclasses.replace(HARDWARE["l4"], peak_fp8_flops_per_s=-1.0)


def test_round_trip_through_dict() -> None:
    hw = HARDWARE["mi300x"]
    assert HardwareSpec.from_dict(hw.to_dict()) == hw
