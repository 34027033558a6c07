"""The packed GEMMs this torch may have (MKL's, oneDNN's): how each packs a weight and
multiplies by the packed copy, which of them this torch has, and their FLOPs for torch's
counter. `packed_linear` picks one and keeps the packed copies."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch.utils.flop_counter import register_flop_formula

from splitphase.hardware.cpuinfo import cpu_has_bf16_instructions

# The row count every weight is packed for, whatever the call that packs it. MKL lays a packed
# copy out for the rows it is told, and a copy serves other row counts at that layout's speed:
# on the 2-core machine (base-125m's four shapes, 2 threads) packed for 32 rows, 512-row GEMMs
# ran 10-15% slower than packed for 512, and packed for 2048, 64- and 512-row GEMMs at half
# speed on three of the four shapes, where packed for 512 was within 5% of the best at 64 to
# 2048 rows (one thread: the same, 32 10-25% slower). Packing for the first call's rows made
# the engine's start-up warm-up (32 tokens) slow every later prefill.
PACK_ROWS = 512


class Gemm(NamedTuple):
    """One packed GEMM: how it packs a weight and multiplies by the packed copy."""

    has: Callable[[], bool]
    pack: Callable[[torch.Tensor], torch.Tensor]
    # (x, packed, plain weight or None, rows) -> x @ w.T
    run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, int], torch.Tensor]
    needs_plain: bool  # the op takes the plain weight too, so a stack of several is kept
    dtypes: tuple[torch.dtype, ...]


def _mkl_run(x: torch.Tensor, packed: torch.Tensor, plain: Any, rows: int) -> torch.Tensor:
    # prepack_batch_size = rows: _mkl_linear takes the packed path only when they are equal.
    return torch.ops.mkl._mkl_linear(x, packed, plain, None, rows)


def _onednn_run(x: torch.Tensor, packed: torch.Tensor, plain: Any, rows: int) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


GEMMS: dict[str, Gemm] = {
    "mkl": Gemm(
        has=lambda: torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear"),
        pack=lambda w: torch.ops.mkl._mkl_reorder_linear_weight(w, PACK_ROWS),
        run=_mkl_run,
        needs_plain=True,
        dtypes=(torch.float32,),
    ),
    "onednn": Gemm(
        has=lambda: torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise"),
        # No row count: oneDNN's layout for 512 rows ran within noise of this one at 64-2048.
        pack=lambda w: torch.ops.mkldnn._reorder_linear_weight(w, None),
        run=_onednn_run,
        needs_plain=False,
        dtypes=(torch.float32, torch.bfloat16),
    ),
}

# Fixed for the process; `packed_linear.usable` asks on every prefill-shaped linear.
HAVE = tuple(name for name, gemm in GEMMS.items() if gemm.has())


@functools.cache
def takes(name: str, dtype: torch.dtype) -> bool:
    """Whether packed GEMM `name` multiplies `dtype` on this CPU at its speed: listed for it,
    a small weight packs and multiplies once, and for bf16 the CPU has bf16 instructions.
    oneDNN's bf16 reorder needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT and raises on an
    AVX2-only CPU (the AMD Zen 3 host). With AVX-512 but no bf16 instructions (an Intel Xeon
    VM, model 207, that hides AVX512-BF16 and AMX) it runs, emulated, at a fifth of the fp32
    GEMM's rate (base-125m's shapes at 512 rows, 2 threads: 62 against 338 GFLOP/s). In both
    cases bf16 linears widen to the fp32 GEMM (`packed_linear.widened_backend`): there a bf16
    prefill of 512 tokens took 0.22x the time it took on oneDNN's bf16."""
    gemm = GEMMS[name]
    if name not in HAVE or dtype not in gemm.dtypes:
        return False
    if dtype == torch.bfloat16 and not cpu_has_bf16_instructions():
        return False
    w = torch.ones(16, 16, dtype=dtype)
    try:
        with torch.no_grad():
            gemm.run(torch.ones(PACK_ROWS, 16, dtype=dtype), gemm.pack(w), w, PACK_ROWS)
    except RuntimeError:
        return False
    return True


def _linear_flops(x_shape: Sequence[int], out_features: int) -> int:
    """2 * rows * in * out, as torch's FLOP counter counts `F.linear` (it knows neither op)."""
    return 2 * math.prod(x_shape[:-1]) * int(x_shape[-1]) * out_features


def _mkl_linear_flops(
    x_shape: Sequence[int], packed_shape: Any, w_shape: Sequence[int], *args: Any, **kwargs: Any
) -> int:
    return _linear_flops(x_shape, int(w_shape[0]))


def _onednn_linear_flops(
    x_shape: Sequence[int], packed_shape: Sequence[int], *args: Any, **kwargs: Any
) -> int:
    return _linear_flops(x_shape, int(packed_shape[0]))  # the packed copy keeps (out, in)


# FlopCounterMode (the audit's check of the FLOP model) sees the GEMMs.
if "mkl" in HAVE:
    register_flop_formula(torch.ops.mkl._mkl_linear)(_mkl_linear_flops)
if "onednn" in HAVE:
    register_flop_formula(torch.ops.mkldnn._linear_pointwise)(_onednn_linear_flops)
