"""Accelerator datasheet figures: the one home of hardware peaks (besides measured calibration).

All figures are per GPU, SI units (1 TFLOP/s = 1e12 FLOP/s, 1 GB = 1e9 bytes), and dense: the
2:4 structured-sparsity numbers NVIDIA prints with an asterisk are exactly 2x and never used here.
`peak_fp32_flops_per_s` is the non-tensor FP32 rate, which is what a torch float32 matmul gets by
default (TF32 is off unless `torch.backends.cuda.matmul.allow_tf32` is set).

Prices are assumptions, not datasheet facts: a typical mid-2025 on-demand list price per GPU-hour
at large GPU clouds (hyperscalers charge more, spot and commitments less). Override them with
`dataclasses.replace(spec, price_usd_per_hour=...)` for your own contract.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from types import MappingProxyType
from typing import Any

TERA = 1e12
GIGA = 1e9


class HardwareError(ValueError):
    """An unknown hardware name or an unusable spec; the message lists what is allowed."""


# dtype spellings accepted by `HardwareSpec.peak_flops_per_s`; fp16 runs at the bf16 rate on all
# the parts in this table.
_DTYPE_FIELD = {
    "bfloat16": "peak_bf16_flops_per_s",
    "bf16": "peak_bf16_flops_per_s",
    "float16": "peak_bf16_flops_per_s",
    "fp16": "peak_bf16_flops_per_s",
    "float8": "peak_fp8_flops_per_s",
    "fp8": "peak_fp8_flops_per_s",
    "int8": "peak_int8_ops_per_s",
    "float32": "peak_fp32_flops_per_s",
    "fp32": "peak_fp32_flops_per_s",
}


@dataclass(frozen=True)
class HardwareSpec:
    """Peak compute, memory and price of one accelerator (or of this CPU, when measured)."""

    name: str
    peak_bf16_flops_per_s: float
    mem_bandwidth_bytes_per_s: float
    mem_capacity_bytes: float
    price_usd_per_hour: float
    source: str
    peak_fp8_flops_per_s: float | None = None
    peak_fp32_flops_per_s: float | None = None
    interconnect_bytes_per_s: float | None = None
    peak_int8_ops_per_s: float | None = None  # integer multiply-adds count 2 ops, as FLOPs do

    def __post_init__(self) -> None:
        required = ("peak_bf16_flops_per_s", "mem_bandwidth_bytes_per_s", "mem_capacity_bytes")
        for field_name in required:
            if not getattr(self, field_name) > 0:
                raise HardwareError(f"{self.name}: {field_name} must be > 0")
        optional = ("peak_fp8_flops_per_s", "peak_fp32_flops_per_s", "interconnect_bytes_per_s",
                    "peak_int8_ops_per_s")
        for field_name in optional:
            value = getattr(self, field_name)
            if value is not None and not value > 0:
                raise HardwareError(f"{self.name}: {field_name} must be > 0 or None")
        if self.price_usd_per_hour < 0:
            raise HardwareError(f"{self.name}: price_usd_per_hour must be >= 0")

    def peak_flops_per_s(self, dtype: str = "bfloat16") -> float:
        """Dense peak FLOP/s for a dtype (bfloat16, float16, float8, float32; int8: ops/s)."""
        field_name = _DTYPE_FIELD.get(dtype.lower())
        if field_name is None:
            raise HardwareError(f"unknown dtype {dtype!r}; choose one of {sorted(_DTYPE_FIELD)}")
        value = getattr(self, field_name)
        if value is None:
            raise HardwareError(f"{self.name} has no {dtype} peak (unsupported or not measured)")
        return float(value)

    def has_peak(self, dtype: str) -> bool:
        """Whether the table (or the measurement) gives a peak for `dtype`."""
        field_name = _DTYPE_FIELD.get(dtype.lower())
        return field_name is not None and getattr(self, field_name) is not None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HardwareSpec:
        return cls(**data)


_NV_H100 = "NVIDIA H100 Tensor Core GPU datasheet (SXM5 / PCIe columns)"
_SPECS = (
    HardwareSpec(
        name="h200",
        peak_bf16_flops_per_s=989 * TERA,
        peak_fp8_flops_per_s=1979 * TERA,
        peak_fp32_flops_per_s=67 * TERA,
        peak_int8_ops_per_s=1979 * TERA,
        mem_bandwidth_bytes_per_s=4.8e12,
        mem_capacity_bytes=141 * GIGA,
        interconnect_bytes_per_s=900 * GIGA,
        price_usd_per_hour=3.50,
        source="NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column (dense = sparse / 2)",
    ),
    HardwareSpec(
        name="h100-sxm",
        peak_bf16_flops_per_s=989 * TERA,
        peak_fp8_flops_per_s=1979 * TERA,
        peak_fp32_flops_per_s=67 * TERA,
        peak_int8_ops_per_s=1979 * TERA,
        mem_bandwidth_bytes_per_s=3.35e12,
        mem_capacity_bytes=80 * GIGA,
        interconnect_bytes_per_s=900 * GIGA,
        price_usd_per_hour=2.50,
        source=f"{_NV_H100}, H100 SXM (dense = sparse / 2)",
    ),
    HardwareSpec(
        name="h100-pcie",
        peak_bf16_flops_per_s=756 * TERA,
        peak_fp8_flops_per_s=1513 * TERA,
        peak_fp32_flops_per_s=51 * TERA,
        peak_int8_ops_per_s=1513 * TERA,
        mem_bandwidth_bytes_per_s=2.0e12,
        mem_capacity_bytes=80 * GIGA,
        interconnect_bytes_per_s=600 * GIGA,  # NVLink bridge, pairs only
        price_usd_per_hour=2.00,
        source=f"{_NV_H100}, H100 PCIe (dense = sparse / 2)",
    ),
    HardwareSpec(
        name="a100-80gb",
        peak_bf16_flops_per_s=312 * TERA,
        peak_fp8_flops_per_s=None,  # Ampere has no FP8 tensor cores
        peak_fp32_flops_per_s=19.5 * TERA,
        peak_int8_ops_per_s=624 * TERA,
        mem_bandwidth_bytes_per_s=2.039e12,
        mem_capacity_bytes=80 * GIGA,
        interconnect_bytes_per_s=600 * GIGA,
        price_usd_per_hour=1.50,
        source=("NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM column"
                " (int8 624 TOPS; 1248 with sparsity)"),
    ),
    HardwareSpec(
        name="l4",
        peak_bf16_flops_per_s=121 * TERA,
        peak_fp8_flops_per_s=242.5 * TERA,
        peak_fp32_flops_per_s=30.3 * TERA,
        peak_int8_ops_per_s=242.5 * TERA,
        mem_bandwidth_bytes_per_s=300 * GIGA,
        mem_capacity_bytes=24 * GIGA,
        interconnect_bytes_per_s=None,  # PCIe only, no NVLink
        price_usd_per_hour=0.70,
        source=("NVIDIA L4 Tensor Core GPU datasheet (242 bf16 / 485 fp8 and int8 with sparsity,"
                " halved)"),
    ),
    HardwareSpec(
        name="l40s",
        peak_bf16_flops_per_s=362 * TERA,
        peak_fp8_flops_per_s=733 * TERA,
        peak_fp32_flops_per_s=91.6 * TERA,
        peak_int8_ops_per_s=733 * TERA,
        mem_bandwidth_bytes_per_s=864 * GIGA,
        mem_capacity_bytes=48 * GIGA,
        interconnect_bytes_per_s=None,  # PCIe only, no NVLink
        price_usd_per_hour=1.00,
        source=("NVIDIA L40S datasheet (362.05 bf16 / 733 fp8 and int8 dense; 733 / 1466 with"
                " sparsity)"),
    ),
    HardwareSpec(
        name="mi300x",
        peak_bf16_flops_per_s=1307.4 * TERA,
        peak_fp8_flops_per_s=2614.9 * TERA,
        peak_fp32_flops_per_s=163.4 * TERA,
        peak_int8_ops_per_s=2614.9 * TERA,
        mem_bandwidth_bytes_per_s=5.3e12,
        mem_capacity_bytes=192 * GIGA,
        interconnect_bytes_per_s=896 * GIGA,  # 7 Infinity Fabric links x 128 GB/s
        price_usd_per_hour=2.00,
        source="AMD Instinct MI300X data sheet (dense matrix peaks, no sparsity)",
    ),
    HardwareSpec(
        name="b200",
        peak_bf16_flops_per_s=2250 * TERA,
        peak_fp8_flops_per_s=4500 * TERA,
        peak_fp32_flops_per_s=75 * TERA,
        peak_int8_ops_per_s=4500 * TERA,
        mem_bandwidth_bytes_per_s=8.0e12,
        mem_capacity_bytes=180 * GIGA,
        interconnect_bytes_per_s=1800 * GIGA,
        price_usd_per_hour=5.00,
        source=(
            "NVIDIA HGX B200 datasheet, per GPU at 1,000 W (4.5 PF bf16 / 9 PF fp8 / 9 POPS int8"
            " with sparsity, halved); some revisions list 7.7 TB/s and 192 GB"
        ),
    ),
)

# Read-only so no caller can mutate the table (STYLE habit 5: no module-global mutable state).
HARDWARE: MappingProxyType[str, HardwareSpec] = MappingProxyType({s.name: s for s in _SPECS})
_ALIASES = MappingProxyType({"h100": "h100-sxm", "a100": "a100-80gb", "b200-sxm": "b200"})


# Substrings of the name a GPU's driver reports (torch.cuda.get_device_name) -> table name;
# the first match wins, so the more specific needles come first.
_GPU_NAMES = (("h200", "h200"), ("h100 pcie", "h100-pcie"), ("h100", "h100-sxm"),
              ("a100", "a100-80gb"), ("l40s", "l40s"), ("l4", "l4"), ("b200", "b200"),
              ("mi300x", "mi300x"))


def hardware_for_gpu(device_name: str) -> str | None:
    """The table's name for a GPU by the name its driver reports, or None if unknown."""
    name = device_name.lower()
    return next((table for needle, table in _GPU_NAMES if needle in name), None)


def list_hardware() -> list[str]:
    """Valid names for `get_hardware`, including the measured `cpu`."""
    return [*HARDWARE, "cpu"]


def get_hardware(name: str) -> HardwareSpec:
    """A spec by name; `cpu` is measured on this machine (cached) by `calibrate`."""
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key == "cpu":
        from splitphase.hardware.calibrate import calibrate  # lazy: calibrate imports torch

        return calibrate(quick=True)
    if key not in HARDWARE:
        raise HardwareError(
            f"unknown hardware {name!r}; choose one of: {', '.join(list_hardware())}"
        )
    return HARDWARE[key]


@dataclass(frozen=True)
class LinkSpec:
    """A link that carries KV caches between machines (or all-reduces within one): bandwidth
    per direction and per-message latency, SI units."""

    name: str
    bytes_per_s: float
    latency_s: float
    source: str

    def __post_init__(self) -> None:
        if not self.bytes_per_s > 0 or self.latency_s < 0:
            raise HardwareError(f"{self.name}: bytes_per_s must be > 0 and latency_s >= 0")

    def transfer_s(self, num_bytes: float) -> float:
        """Time to move `num_bytes` in one message: latency + bytes / bandwidth."""
        return self.latency_s + num_bytes / self.bytes_per_s


# Per-direction figures: a GPU's NVLink total (e.g. 900 GB/s on H100) counts both directions.
_LINKS = (
    LinkSpec("nvlink", 450 * GIGA, 5e-6,
             "NVLink 4 (H100 SXM): 900 GB/s bidirectional per GPU, half per direction"),
    LinkSpec("infiniband", 50 * GIGA, 5e-6,
             "InfiniBand NDR 400 Gb/s per GPU (ConnectX-7), one NIC per GPU"),
    LinkSpec("ethernet", 12.5 * GIGA, 50e-6, "100 Gb/s Ethernet (TCP), one NIC per GPU"),
)
LINKS: MappingProxyType[str, LinkSpec] = MappingProxyType({lk.name: lk for lk in _LINKS})


def get_link(name: str) -> LinkSpec:
    """A link by name: nvlink, infiniband or ethernet."""
    key = name.strip().lower()
    if key not in LINKS:
        raise HardwareError(f"unknown link {name!r}; choose one of: {', '.join(LINKS)}")
    return LINKS[key]
