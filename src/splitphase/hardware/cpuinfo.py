"""Which CPU this is, from /proc/cpuinfo: its model name, vendor and family/model numbers.

Cloud VMs often report a bare model name ("AMD EPYC" on both a Zen 4 and a Zen 5 host), so a
cache keyed by the name alone would serve one host's peaks to the other; the family and model
numbers tell them apart.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path


def first_processor(text: str) -> dict[str, str]:
    """The first processor's fields of a /proc/cpuinfo text, by lower-case name."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block ends here
            continue
        name, _, value = line.partition(":")
        fields.setdefault(name.strip().lower(), value.strip())
    return fields


@functools.cache
def _first_cpu() -> dict[str, str]:
    try:
        return first_processor(Path("/proc/cpuinfo").read_text())
    except OSError:
        return {}


def cpu_model_name() -> str:
    """The CPU model from /proc/cpuinfo (falls back to `platform.processor()`)."""
    return (_first_cpu().get("model name") or platform.processor() or platform.machine()
            or "unknown-cpu")


def cpu_vendor() -> str:
    """The vendor string ("GenuineIntel", "AuthenticAMD"), "" where it is not known."""
    return _first_cpu().get("vendor_id", "")


def cpu_signature() -> str:
    """Vendor, family and model ("AuthenticAMD 25/17"): the same name may cover several."""
    cpu = _first_cpu()
    return f"{cpu_vendor()} {cpu.get('cpu family', '?')}/{cpu.get('model', '?')}"


def cpu_flags() -> frozenset[str]:
    """The first processor's feature flags ("avx2", "avx512f", ...); empty where unknown."""
    return frozenset(_first_cpu().get("flags", "").split())


def cpu_has_avx512() -> bool:
    """Whether the CPU has AVX-512 F, BW and VL (what the native kernels' AVX-512 code needs)."""
    return {"avx512f", "avx512bw", "avx512vl"} <= cpu_flags()


# Instructions that multiply or convert bf16 in hardware: AVX512-BF16's dot product, AMX's tiles,
# AVX-NE-CONVERT's conversions. Without any of them oneDNN emulates its bf16 GEMM.
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "avx_ne_convert"})


def cpu_has_bf16_instructions() -> bool:
    """Whether the CPU has bf16 instructions (`BF16_FLAGS`); True where its flags are unknown
    (no /proc/cpuinfo), so that there a bf16 GEMM that runs is taken as it always was."""
    flags = cpu_flags()
    return not flags or bool(BF16_FLAGS & flags)
