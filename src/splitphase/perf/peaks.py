"""This machine's peaks, measured in the same run and thread count as the phases they judge."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from splitphase.audit.flops import dense_linear_shapes, prefill_flops
from splitphase.hardware.calibrate import (
    measure_gemm_flops_per_s,
    measure_triad_bandwidth_bytes_per_s,
)
from splitphase.hardware.specs import HARDWARE, hardware_for_gpu
from splitphase.kernels import gemm_choice, packed_gemms, packed_linear
from splitphase.model.config import ModelConfig
from splitphase.perf.timing import best_s


def model_matmul_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(out, in) of every distinct weight of a dense decoder, the LM head included."""
    shapes = {
        (cfg.q_dim, cfg.d_model),
        (cfg.kv_dim, cfg.d_model),
        (cfg.d_model, cfg.q_dim),
        (cfg.d_ff, cfg.d_model),
        (cfg.d_model, cfg.d_ff),
        (cfg.vocab_size, cfg.d_model),
    }
    return sorted(shapes)


def matmul_peak_flops_per_s(
    cfg: ModelConfig,
    dtype: torch.dtype,
    rows: int = 512,
    repeats: int = 5,
    device: torch.device | str = "cpu",
) -> dict[str, float]:
    """Best linear FLOP/s over the model's weight shapes at `rows` tokens, in `dtype`.

    Each shape takes the fastest of torch's linear and the GEMM on a packed weight by every
    backend this torch has (MKL's, oneDNN's; switched on here even where the model's prefill
    leaves packing off or picked the other): the peak is the best GEMM this machine offers,
    not the one the model happens to use.
    """
    g = torch.Generator().manual_seed(0)
    best, by_shape = 0.0, {}
    for out_f, in_f in model_matmul_shapes(cfg):
        x = torch.randn(rows, in_f, generator=g).to(device, dtype)
        w = torch.randn(out_f, in_f, generator=g).to(device, dtype)
        seconds = best_s(partial(F.linear, x, w), repeats)
        for name in packed_linear.backends():
            if not packed_gemms.takes(name, dtype) and packed_linear.widened_backend(dtype) is None:
                continue  # (the model's bf16 may take an fp32 GEMM widened: a peak counts it)
            with packed_linear.switched(True), packed_linear.using_backend(name):
                if packed_linear.usable(x, w):
                    seconds = min(seconds, _packed_forms_s(x, w, repeats))
        rate = 2 * rows * in_f * out_f / seconds
        by_shape[f"{out_f}x{in_f}"] = rate
        best = max(best, rate)
    return {"best": best, **by_shape}


def _packed_forms_s(x: torch.Tensor, w: torch.Tensor, repeats: int) -> float:
    """The best seconds of x @ w.T on a packed copy of w over the packed forms (whole, split
    in row pieces; `gemm_choice`) that apply at x's rows, with the current backend."""
    pack = packed_linear.PackedWeight()
    rows = x.numel() // x.shape[-1]
    forms = [f for f in gemm_choice.candidates(rows) if f != "torch"]  # torch's: timed apart
    seconds = math.inf
    for form in forms:
        with gemm_choice.forced(form):
            seconds = min(seconds, best_s(partial(packed_linear.linear, x, w, pack), repeats))
    return seconds


def gemm_pass(
    cfg: ModelConfig, dtype: torch.dtype, rows: int, device: torch.device
) -> tuple[Callable[[], object], float]:
    """(one call, its FLOPs) of the model's gate/up GEMM, rows x d_model by d_ff x d_model,
    the prefill's largest share of FLOPs, as the prefill runs it (packed where it would be):
    timed in alternation with a prefill, it is the peak that prefill met."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, cfg.d_model, generator=g).to(device, dtype)
    w = torch.randn(cfg.d_ff, cfg.d_model, generator=g).to(device, dtype)
    pack = packed_linear.PackedWeight()

    def run() -> object:
        out = packed_linear.linear(x, w, pack)
        return F.linear(x, w) if out is None else out

    return run, 2.0 * rows * cfg.d_model * cfg.d_ff


def prefill_gemm_ceiling(
    cfg: ModelConfig, peaks: dict[str, float], dtype: str, prompt_len: int
) -> float:
    """The fraction of the matmul peak a prefill could reach at best with these GEMMs.

    Each layer linear runs at the rate measured for its shape alone (operands hot in cache,
    at the peaks' row count), everything else (attention, LM head) at the peak itself, and
    norms, RoPE and the rest take no time: no prefill built on these GEMMs can beat it.
    """
    total = prefill_flops(cfg, prompt_len)
    linear_flops = linear_s = 0.0
    for out_f, in_f, count in dense_linear_shapes(cfg):
        flops = 2.0 * prompt_len * out_f * in_f * count * cfg.n_layers
        linear_flops += flops
        linear_s += flops / peaks[f"gemm_{dtype}_{out_f}x{in_f}_flops_per_s"]
    peak = peaks[f"matmul_model_shapes_flops_per_s_{dtype}"]
    return total / (linear_s + (total - linear_flops) / peak) / peak


def datasheet_peaks(device: torch.device) -> dict[str, float]:
    """The hardware table's bandwidth and bf16 peak for a recognised GPU (H100/H200/A100)."""
    if device.type != "cuda":
        return {}
    key = hardware_for_gpu(torch.cuda.get_device_name(device))
    if key is None:
        return {}
    spec = HARDWARE[key]
    return {
        "datasheet_bandwidth_bytes_per_s": spec.mem_bandwidth_bytes_per_s,
        "datasheet_bf16_flops_per_s": spec.peak_bf16_flops_per_s,
    }


def triad_pass(device: torch.device, mib_per_array: int) -> tuple[Callable[[], object], int]:
    """One STREAM triad pass a = b + 3c in fp32 on `device`, and the bytes it moves (3 arrays)."""
    n = mib_per_array * 2**20 // 4
    b, c = torch.rand(n, device=device), torch.rand(n, device=device)
    a = torch.empty_like(b)
    return partial(torch.add, b, c, alpha=3.0, out=a), 3 * n * 4


def read_pass(device: torch.device, mib: int) -> tuple[Callable[[], object], int]:
    """One read-only pass (the sum of an fp32 array) on `device`, and the bytes it reads: the
    traffic of a batch-1 decode step's weight stream, with no write. On the AMD Zen 4 host a
    sum read 0.75-1.0x the triad's bytes per second in a script outside the repo and 0.94-1.04x
    in phase_limits' bursts: the triad is not always what a read can reach."""
    x = torch.rand(mib * 2**20 // 4, device=device)
    return x.sum, x.numel() * 4


def triad_bytes_per_s(device: torch.device, mib_per_array: int, repeats: int) -> float:
    """STREAM triad a = b + 3c in fp32 on `device`; 3 arrays of traffic per pass."""
    if device.type == "cpu":
        return measure_triad_bandwidth_bytes_per_s(mib_per_array, repeats)
    run, nbytes = triad_pass(device, mib_per_array)
    return nbytes / best_s(run, repeats)


def measure_peaks(
    cfg: ModelConfig, dtypes: list[str], quick: bool, device: torch.device
) -> dict[str, float]:
    """Triad bandwidth and matmul FLOP/s (model shapes; square on CPU) per dtype."""
    mib, repeats = (32, 3) if quick else (256, 8)
    if device.type == "cuda":
        mib = 2048 if not quick else 256
    rows = 64 if quick else 512
    out = {"triad_bytes_per_s": triad_bytes_per_s(device, mib, repeats), **datasheet_peaks(device)}
    for name in dtypes:
        dtype = getattr(torch, name)
        shapes = matmul_peak_flops_per_s(cfg, dtype, rows, repeats, device)
        out[f"matmul_model_shapes_flops_per_s_{name}"] = shapes.pop("best")
        out.update({f"gemm_{name}_{shape}_flops_per_s": r for shape, r in shapes.items()})
        if device.type == "cpu":
            out[f"matmul_square_flops_per_s_{name}"] = measure_gemm_flops_per_s(
                name, max_n=512 if quick else 2048, repeats=repeats
            )
    return out
