"""Decode-shaped linear layers: the native skinny kernel for a few rows, torch otherwise.

A decode step multiplies a handful of rows (one per sequence) by every weight: the cost is
reading the weights. The native kernel reads each weight row once for all rows, on all
intra-op threads, and fuses the projections that share an input (Q/K/V; SwiGLU's gate and
up). Larger inputs (prefill) and anything the kernel does not cover (GPU, fp16, autograd)
take the plain torch path, which is the reference.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula

from splitphase.kernels import build, elementwise, packed_linear
from splitphase.kernels.switch import Switch, switch_functions

# Rows up to which the kernel beats torch, measured on the 2-core AVX-512 machine, quiet
# (`bench/skinny_rows.py [--dtype bfloat16]`: base-125m's MLP linears, weights from memory):
# fp32 up to 48, where torch's GEMM draws level (the kernel 2.3x faster at 8 rows, 1.2x at 32,
# 1.05x at 48, 0.95x at 64; it takes up to 64); bf16 up to 8 (1.98x oneDNN at 1 row, 1.6x at
# 4, 1.2x at 8, 0.72x at 16: oneDNN's AMX GEMM costs about the same from 1 to 16 rows).
MAX_ROWS = {torch.float32: 48, torch.bfloat16: 8}

# bf16 batches of AMX_MIN_ROWS to AMX_MAX_ROWS rows multiply on AMX tiles where the library has
# them (`amx_tiles.h`), and the kernel keeps bf16 up to AMX_MAX_ROWS. On the Intel AMX host, a
# base-125m bf16 decode step at context 512 (`bench/decode_ab.py --blocks --variants fused
# no_amx_tiles onednn_past_8 --dtypes bfloat16`, and a script alternating the same way): on
# the tiles 1.04-1.10x VDPBF16PS's time at 5 and 6 rows, 0.97-1.0x at 7, 0.87-0.93x at 8; 0.66x
# at 16, 0.58x at 32; oneDNN's AMX GEMM (the path past 8 rows before) 1.20-1.21x the tiles'
# time at 10-12 rows, 1.15-1.20x at 16, 1.09-1.10x at 20-32.
AMX_MIN_ROWS = 7
AMX_MAX_ROWS = 32

# The most rows one call takes (skinny_linear.cpp's kMaxRows). bf16 goes to it where no packed
# GEMM multiplies bf16 (oneDNN's needs AVX-512 or AVX-NE-CONVERT) and the build has the AVX2
# outer-product tile: on the AVX2-only Zen 3 host (`bench/skinny_rows.py --dtype bfloat16`,
# base-125m's MLP linears) the kernel took 0.31-0.54x torch's bf16 linear's time from 1 to 64
# rows. With AVX-512 but no bf16 instructions (no outer tile; an Intel Xeon VM) it keeps bf16
# below packed_linear.MIN_ROWS, past which the fp32 packed GEMM on bf16 widened is faster (the
# same bench with that GEMM timed from 8 rows: its time over the kernel's 1.92 at 8 rows, 1.24
# at 16, 0.98 at 24, 0.83 at 32, 0.63 at 64).
KERNEL_ROWS = 64

# On an AVX2 build (no AVX-512), calls of OUTER_MIN_ROWS rows or more take the outer-product
# tile (`skinny_outer_avx2.h`). On the Zen 3 host, base-125m's layer linears (12 layers of
# distinct weights, one process, the tile switched on and off in turn: bench/outer_tile_ab.py
# and a script like it) took 0.73-0.83x the dot tile's time at 16 rows, 0.84-0.88x at 32,
# 0.90-0.94x at 48, 0.84-0.91x at 64 in fp32; bf16 0.89x at 16, 0.91x at 32, 0.86x at 64; the
# same at 11-12 rows, 1.08-1.20x at 9-10 (padded to 16). A row's result is the same for any row
# count from OUTER_MIN_ROWS on, and for any below it, but not across it.
OUTER_MIN_ROWS = 12


_SWITCH = Switch()


set_enabled, switched, is_enabled = switch_functions(
    _SWITCH, requires=build.available, module=__name__,
    set_doc="Turn the native decode path on or off for this process (torch fallback when off).",
    switched_doc="Every native kernel on (or off) inside the block, as it was after it.",
    enabled_doc="True when the native decode path is on and its library loaded.",
)


_helper_rows_sent: int | None = None  # the native pool's helper limit, as last set


_amx_kernel: bool | None = None


def amx_kernel() -> bool:
    """Whether the loaded library multiplies bf16 on AMX tiles (built for and permitted on
    this CPU); the first call also sets the rows from which it does."""
    global _amx_kernel
    if _amx_kernel is None:
        _amx_kernel = build.available() and bool(
            torch.ops.splitphase.set_amx_min_rows(AMX_MIN_ROWS))
    return _amx_kernel


def _skinny_linear_flops(
    x_shape: Sequence[int], w_shapes: Sequence[Sequence[int]], *args: Any, **kwargs: Any
) -> int:
    """2 * rows * in * out for every weight, as torch's FLOP counter counts `F.linear`."""
    rows, k = math.prod(x_shape[:-1]), int(x_shape[-1])
    return sum(2 * rows * k * int(w[0]) for w in w_shapes)


def register_flops() -> None:
    """Let FlopCounterMode (the audit's check of its FLOP model) see the kernel's linears: a
    short prompt's prefill (up to KERNEL_ROWS tokens) can run on it. Called by `build` once
    the library is loaded."""
    register_flop_formula(torch.ops.splitphase.skinny_linear)(_skinny_linear_flops)


_outer_tile: bool | None = None


def outer_tile() -> bool:
    """Whether the loaded library has the AVX2 outer-product tile; the first call also sets the
    rows from which it serves (OUTER_MIN_ROWS)."""
    global _outer_tile
    if _outer_tile is None:
        _outer_tile = build.available() and bool(
            torch.ops.splitphase.set_outer_min_rows(OUTER_MIN_ROWS))
    return _outer_tile


def own_rows(dtype: torch.dtype) -> int:
    """Rows up to which the kernel beats torch's linear in `dtype` on this CPU."""
    if dtype == torch.bfloat16 and amx_kernel():
        return AMX_MAX_ROWS
    if dtype == torch.bfloat16 and packed_linear.backend_for(dtype) is None:
        if outer_tile() or packed_linear.widened_backend(dtype) is None:
            return KERNEL_ROWS
        return packed_linear.MIN_ROWS - 1  # then the fp32 packed GEMM, bf16 widened (above)
    if dtype == torch.float32 and outer_tile():
        # Its outer-product tile outruns torch's and MKL's packed GEMM to the kernel's last
        # row (Zen 3, `bench/skinny_rows.py`: at 48 rows torch/kernel 1.36, packed/kernel 1.45;
        # at 64 1.18 and 1.25).
        return KERNEL_ROWS
    return MAX_ROWS.get(dtype, 0)


def _kernel_rows(dtype: torch.dtype) -> int:
    rows = own_rows(dtype)
    if packed_linear.is_enabled() and packed_linear.backend_for(dtype) == "onednn":
        rows = min(rows, packed_linear.min_rows(dtype) - 1)
    return rows


def max_rows(dtype: torch.dtype) -> int:
    """Rows up to which the kernel serves a linear in `dtype`: `own_rows`, or fewer where
    oneDNN's packed GEMM takes over earlier (`packed_linear.min_rows`).

    The native kernels' helper threads serve calls up to these rows; past them a decode step
    runs torch's OpenMP GEMMs, whose still-spinning team the element-wise kernels then join
    (on the helpers they raced it for the cores: a 16-row step of base-125m fp32 took twice
    as long)."""
    global _helper_rows_sent
    if is_enabled():
        limit = max(_kernel_rows(d) for d in MAX_ROWS)
        if limit != _helper_rows_sent:
            torch.ops.splitphase.set_helper_max_rows(limit)
            _helper_rows_sent = limit
    return _kernel_rows(dtype)


def _use_kernel(x: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> bool:
    if not is_enabled():  # first: a compiled graph that runs torch's path must not guard on rows
        return False
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    # own_rows, not max_rows: a call past max_rows gets here only where no packed GEMM took
    # it (a weight the packing budget refused), and up to own_rows the kernel beats torch's.
    if not (0 < rows <= own_rows(x.dtype) and x.device.type == "cpu"):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)):
        return False
    return all(w.dtype == x.dtype and w.is_contiguous() for w in weights)


def _native(x: torch.Tensor, weights: list[torch.Tensor], pass_rows: int) -> list[torch.Tensor]:
    return list(torch.ops.splitphase.skinny_linear(x, weights, pass_rows))


def linears(
    x: torch.Tensor, *weights: torch.Tensor, pass_rows: int = 0
) -> tuple[torch.Tensor, ...]:
    """x @ w.T for each weight (nn.Linear layout, no bias), sharing one pass over x.

    pass_rows: the tokens of the forward pass whose last rows x is (the LM head after a
    prefill). Above a decode step's size the kernel then runs on torch's OpenMP team, still
    spinning from the pass's GEMMs, as the pass's own element-wise kernels do: the helper
    threads would race it for the cores (a 512-token prefill's LM head 5.4 -> 3.4 ms)."""
    if not _use_kernel(x, weights):
        return tuple(F.linear(x, w) for w in weights)
    ys = _native(x.reshape(-1, x.shape[-1]), list(weights), pass_rows)
    return tuple(y.unflatten(0, x.shape[:-1]) for y in ys)  # (..., N_j) each, contiguous


def linear(x: torch.Tensor, weight: torch.Tensor, pass_rows: int = 0) -> torch.Tensor:
    """x @ weight.T (no bias); the native kernel for decode-shaped x (pass_rows: `linears`)."""
    return linears(x, weight, pass_rows=pass_rows)[0]


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T); gate and up share one pass in decode."""
    g, u = linears(x, gate, up)
    return elementwise.silu_mul(g, u)
