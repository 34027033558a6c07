"""Roofline model (Williams, Waterman and Patterson, CACM 2009): pure functions, SI units.

Attainable FLOP/s = min(peak FLOP/s, intensity * bandwidth); the ridge point, peak / bandwidth,
separates memory-bound work (left of it) from compute-bound work (at or right of it).
Peaks come only from a `HardwareSpec` (datasheet table or measured calibration).
"""

from __future__ import annotations

import math
from typing import Literal

from splitphase.hardware.specs import HardwareSpec

Bound = Literal["compute", "memory"]


class RooflineError(ValueError):
    """Inputs the roofline math cannot use (zero or negative time, peaks, or counts)."""


def _require_positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise RooflineError(f"{name} must be a finite number > 0, got {value!r}")


def _require_non_negative(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise RooflineError(f"{name} must be a finite number >= 0, got {value!r}")


def ridge_point(hw: HardwareSpec, dtype: str = "bfloat16") -> float:
    """FLOP per byte where the roofline bends: peak FLOP/s / memory bandwidth."""
    return hw.peak_flops_per_s(dtype) / hw.mem_bandwidth_bytes_per_s


def attainable_flops_per_s(intensity: float, hw: HardwareSpec, dtype: str = "bfloat16") -> float:
    """min(peak FLOP/s, intensity * bandwidth)."""
    _require_non_negative("intensity", intensity)
    return min(hw.peak_flops_per_s(dtype), intensity * hw.mem_bandwidth_bytes_per_s)


def classify(intensity: float, hw: HardwareSpec, dtype: str = "bfloat16") -> Bound:
    """`compute` at or above the ridge point, else `memory`."""
    _require_non_negative("intensity", intensity)
    return "compute" if intensity >= ridge_point(hw, dtype) else "memory"


def roofline_time_s(flops: float, bytes: float, hw: HardwareSpec, dtype: str = "bfloat16") -> float:
    """Lower bound on time: max(flops / peak, bytes / bandwidth), assuming perfect overlap."""
    _require_non_negative("flops", flops)
    _require_non_negative("bytes", bytes)
    return max(flops / hw.peak_flops_per_s(dtype), bytes / hw.mem_bandwidth_bytes_per_s)


def flops_utilization(flops: float, seconds: float, peak_flops_per_s: float) -> float:
    """Achieved FLOP/s as a fraction of peak (MFU when `flops` are model FLOPs)."""
    _require_non_negative("flops", flops)
    _require_positive("seconds", seconds)
    _require_positive("peak_flops_per_s", peak_flops_per_s)
    return flops / seconds / peak_flops_per_s


def bandwidth_utilization(bytes: float, seconds: float, peak_bytes_per_s: float) -> float:
    """Achieved bytes/s as a fraction of peak bandwidth (MBU when `bytes` are model bytes)."""
    _require_non_negative("bytes", bytes)
    _require_positive("seconds", seconds)
    _require_positive("peak_bytes_per_s", peak_bytes_per_s)
    return bytes / seconds / peak_bytes_per_s
