"""Measure this machine's peaks (STREAM triad bandwidth, GEMM FLOP/s) as a `HardwareSpec("cpu")`.

Results are cached as JSON under `$SPLITPHASE_CACHE` (default `~/.cache/splitphase`), keyed by
CPU model, torch thread count and torch version, because those are what change the numbers.
Torch threads are used as the caller set them; we never change them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from splitphase.hardware.cpuinfo import cpu_model_name, cpu_signature
from splitphase.hardware.specs import HardwareSpec

# Assumption, not a measurement: a typical 2-vCPU general-purpose cloud VM on demand
# (e.g. AWS m7i.large, us-east-1, about $0.10/h in 2025).
DEFAULT_CPU_PRICE_USD_PER_HOUR = 0.10
_MIB = 2**20
_CACHE_VERSION = 4  # 2: GEMM peak is the best rate over sizes; 3: and over packed GEMMs;
# 4: bf16 also over an fp32 GEMM on a widened copy, where none takes bf16
# A spot probe this much above a cached peak means the cache was measured under load.
_STALE_MARGIN = 1.15
_TRIAD_MIB = {True: 64, False: 256}  # per array, quick and full


def cache_dir() -> Path:
    """Where calibrations are cached: `$SPLITPHASE_CACHE` or `~/.cache/splitphase`."""
    env = os.environ.get("SPLITPHASE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "splitphase"


def _cache_key() -> dict[str, Any]:
    import torch

    return {
        "cpu": cpu_model_name(),
        "cpu_signature": cpu_signature(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def _cache_path(key: dict[str, Any], quick: bool) -> Path:
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / f"calibration-{digest}-{'quick' if quick else 'full'}.json"


def _best_time_s(fn: Callable[[], object], repeats: int, budget_s: float) -> float:
    """Best wall time of `fn` over up to `repeats` runs (at least one), stopping at `budget_s`."""
    fn()  # warm-up: first touch faults pages in and lets the BLAS pick its kernel
    best = float("inf")
    start = time.perf_counter()
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s:
            break
    return best


def measure_triad_bandwidth_bytes_per_s(mib_per_array: int = 64, repeats: int = 5) -> float:
    """STREAM triad a = b + s*c in float32; counts 3 arrays of traffic per pass."""
    import torch

    n = mib_per_array * _MIB // 4
    b = torch.rand(n, dtype=torch.float32)
    c = torch.rand(n, dtype=torch.float32)
    a = torch.empty_like(b)
    # One fused kernel reads b and c and writes a (STREAM convention: 3 * n * 4 bytes).
    seconds = _best_time_s(lambda: torch.add(b, c, alpha=3.0, out=a), repeats, budget_s=2.0)
    return 3 * n * 4 / seconds


def _packed_products(x: Any, w: Any) -> list[Callable[[], object]]:
    """x @ w.T on a packed copy of w by every packed GEMM this torch has for x's dtype (MKL's,
    oneDNN's; an fp32 one on a widened copy where none takes bf16), as the model's prefill
    linears run: on a host where MKL takes its AVX2 path
    (AMD Zen 5) oneDNN's ran 2.3x torch's matmul, and a peak under the prefill's own rate
    made the audit report prefill above 100% of it."""
    import torch

    from splitphase.kernels import packed_gemms, packed_linear

    products: list[Callable[[], object]] = []
    widened = packed_linear.widened_backend(x.dtype) is not None
    for name in packed_linear.backends():
        gemm = packed_gemms.GEMMS[name]
        if packed_gemms.takes(name, x.dtype):
            products.append(functools.partial(gemm.run, x, gemm.pack(w), w, x.shape[0]))
        elif widened and packed_gemms.takes(name, torch.float32):  # as the model's bf16 runs
            wf = w.float()
            products.append(functools.partial(_widened_run, gemm, x, gemm.pack(wf), wf))
    return products


def _widened_run(gemm: Any, x: Any, packed: Any, plain: Any) -> object:
    return gemm.run(x.float(), packed, plain, x.shape[0]).to(x.dtype)


def measure_gemm_flops_per_s(
    dtype_name: str = "float32", max_n: int = 2048, target_s: float = 0.05, repeats: int = 5
) -> float:
    """Best square-matmul FLOP/s (2*n^3 per n x n product) in a dtype, sized to this machine:
    torch's matmul or a GEMM on a packed weight, whichever is faster."""
    import torch

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if dtype_name not in dtypes:
        raise ValueError(f"GEMM calibration supports {sorted(dtypes)}, got {dtype_name!r}")
    dtype = dtypes[dtype_name]
    # Keep the best rate over growing sizes: small products under-use the cores (a 256^3
    # fp32 product can run 20x below peak), and a loaded machine makes any single probe noisy.
    best, n = 0.0, 256
    while n <= max_n:
        x = torch.randn(n, n, dtype=dtype)
        y = torch.randn(n, n, dtype=dtype)
        out = torch.empty(n, n, dtype=dtype)
        torch.matmul(x, y, out=out)  # untimed: the first call pays for thread-pool start-up
        with torch.no_grad():
            products: list[Callable[[], object]] = [
                functools.partial(torch.matmul, x, y, out=out), *_packed_products(x, y)
            ]
            seconds = min(_best_time_s(p, repeats, budget_s=target_s * 10) for p in products)
        best = max(best, 2 * n**3 / seconds)
        if seconds > target_s:  # the next size costs 8x: enough
            break
        n *= 2
    return best


def _mem_capacity_bytes() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024  # reported in KiB
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _measure(quick: bool, key: dict[str, Any], price_usd_per_hour: float) -> HardwareSpec:
    mib, repeats, max_n = _TRIAD_MIB[quick], *((3, 1024) if quick else (10, 4096))
    bandwidth = measure_triad_bandwidth_bytes_per_s(mib_per_array=mib, repeats=repeats)
    fp32 = measure_gemm_flops_per_s("float32", max_n=max_n, repeats=repeats)
    bf16 = measure_gemm_flops_per_s("bfloat16", max_n=max_n, repeats=repeats)
    return HardwareSpec(
        name="cpu",
        peak_bf16_flops_per_s=bf16,
        peak_fp32_flops_per_s=fp32,
        peak_fp8_flops_per_s=None,
        mem_bandwidth_bytes_per_s=bandwidth,
        mem_capacity_bytes=_mem_capacity_bytes(),
        price_usd_per_hour=price_usd_per_hour,
        interconnect_bytes_per_s=None,
        source=(
            f"measured {'quick' if quick else 'full'}: triad {mib} MiB/array, square GEMM (torch's "
            f"or packed) up to n={max_n}; {key['cpu']}, {key['threads']} torch threads, torch "
            f"{key['torch']}; price assumed"
        ),
    )


def _load(path: Path, key: dict[str, Any]) -> HardwareSpec | None:
    try:
        data = json.loads(path.read_text())
        if data.get("version") != _CACHE_VERSION or data.get("key") != key:
            return None
        return HardwareSpec.from_dict(data["spec"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # a missing or corrupt cache is just a cache miss


def calibrate(
    quick: bool = False,
    refresh: bool = False,
    price_usd_per_hour: float = DEFAULT_CPU_PRICE_USD_PER_HOUR,
) -> HardwareSpec:
    """Measured peaks of this machine as `HardwareSpec("cpu")`, cached per CPU/threads/torch."""
    key = _cache_key()
    if not refresh:
        # A full calibration is better than a quick one, so a quick request accepts either.
        for mode in [False, True] if quick else [False]:
            path = _cache_path(key, mode)
            cached = _load(path, key)
            if cached is None:
                continue
            if _beaten(cached, _spot_probe(mode)):
                path.unlink(missing_ok=True)  # stale: never probe it again
                continue
            # The price is an assumption, not a measurement, so the caller's value wins.
            return replace(cached, price_usd_per_hour=price_usd_per_hour)
    spec = _measure(quick, key, price_usd_per_hour)
    _store(spec, _cache_path(key, quick), key)
    return spec


def _spot_probe(quick: bool) -> tuple[float, float]:
    """A cheap triad and fp32 GEMM, (bytes/s, FLOP/s), to check a cached calibration.

    The triad uses the cached calibration's array size: smaller arrays would sit in the
    last-level cache and beat a DRAM figure without proving anything.
    """
    return (
        measure_triad_bandwidth_bytes_per_s(mib_per_array=_TRIAD_MIB[quick], repeats=2),
        measure_gemm_flops_per_s("float32", max_n=512, repeats=3),
    )


def _beaten(cached: HardwareSpec, probe: tuple[float, float]) -> bool:
    """Whether a spot probe beats the cached peaks by more than noise.

    A calibration taken while other jobs held the cores stays cached and then makes every
    report claim over 100% use; a peak is an upper bound, so a probe above it proves it stale.
    """
    bandwidth, fp32 = probe
    return bandwidth > _STALE_MARGIN * cached.mem_bandwidth_bytes_per_s or fp32 > _STALE_MARGIN * (
        cached.peak_fp32_flops_per_s or float("inf")
    )


def _store(spec: HardwareSpec, path: Path, key: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"version": _CACHE_VERSION, "key": key, "spec": spec.to_dict()}))
        tmp.replace(path)  # atomic, so a concurrent reader never sees half a file
    except OSError:
        pass  # an unwritable cache only costs a re-measurement next time
