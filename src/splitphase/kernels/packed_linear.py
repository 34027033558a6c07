"""Prefill-shaped fp32 linears on pre-packed weights (MKL's packed GEMM), or torch.

torch's fp32 linear calls MKL's sgemm, which repacks the weight into its blocked layout on
every call: for a 512-token prefill of base-125m that is 10-12% of each GEMM (one thread,
best of 15: 14.0 -> 12.6 ms for 512x3072 @ 3072x768). `torch.ops.mkl._mkl_reorder_linear_weight`
packs a weight once (`cblas_sgemm_pack`) and `_mkl_linear` multiplies by the packed copy
(`cblas_sgemm_compute`): the same MKL microkernel, so the result equals `F.linear` within fp32
rounding (bit-identical at most shapes; where MKL's unpacked path blocks K differently, one
ulp apart, as torch's own results differ between row counts). One packed copy serves every
row count, not only the one it was packed at (tests/kernels/test_packed_linear.py checks it).

The cost is memory: MKL's packed copy is ~2.2x the weight (fp32), kept next to the weight that
decode's skinny kernel reads. Packing is lazy (the first prefill-shaped call per weight), so a
model that only trains or decodes never pays it. It is off by default (`set_enabled(True)` or
`SPLITPHASE_PACKED_PREFILL=1` turns it on): on a quiet machine it gained 4.6% at 512 prompt
tokens and lost 2% at 2048 (base-125m, 2 threads), too little for twice the linears' memory,
which a serving engine would rather give to the KV cache.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.flop_counter import register_flop_formula

from splitphase.kernels import build

# Below this many rows a linear is decode-shaped: the skinny kernel (or plain torch) serves it
# and the packing would not pay for its memory.
MIN_ROWS = 32

_SWITCH = build.Switch(on=os.environ.get("SPLITPHASE_PACKED_PREFILL", "0") in ("1", "on"))


def set_enabled(on: bool) -> None:
    """Turn packed prefill linears on or off for this process (torch's linear when off)."""
    _SWITCH.on = on


def switched(on: bool) -> contextlib.AbstractContextManager[None]:
    """Packed prefill linears on (or off) inside the block, as they were after it."""
    return _SWITCH.switched(on)


def is_enabled() -> bool:
    """True when packed prefill linears are on and this torch has MKL's packed GEMM."""
    return _SWITCH.on and available()


def available() -> bool:
    """True when this torch has MKL's packed GEMM (whether or not it is switched on)."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def _mkl_linear_flops(
    x_shape: Sequence[int], packed_shape: Any, w_shape: Sequence[int], *args: Any, **kwargs: Any
) -> int:
    """2 * rows * in * out, as torch's FLOP counter counts `F.linear` (it knows no MKL op)."""
    rows = math.prod(x_shape[:-1])
    return 2 * rows * int(x_shape[-1]) * int(w_shape[0])


if available():  # FlopCounterMode (the audit's check of the FLOP model) sees the GEMM
    register_flop_formula(torch.ops.mkl._mkl_linear)(_mkl_linear_flops)


class PackedWeight:
    """The packed copy of one weight, or of several stacked (Q/K/V: one GEMM for the three),
    rebuilt when any of them changes.

    The key is the weight's storage address, version counter (bumped by every in-place write:
    `load_state_dict`, an optimizer step) and thread count (MKL packs for the threads it will
    compute with), so a stale copy is never used. Copies and pickles start empty: the packed
    tensor is an MKL handle, never saved.
    """

    def __init__(self) -> None:
        self._key: tuple[int, ...] | None = None
        self._packed: torch.Tensor | None = None
        self._stacked: torch.Tensor | None = None  # what was packed: (sum N, K)

    def get(self, ws: Sequence[torch.Tensor], rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed copy, plain stack) of ws on dim 0, rebuilt if any changed since last call.

        `_mkl_linear` takes the plain weight too (its fallback when the row count differs
        from the packing's), so a stack of several is kept: never a stand-in that would be
        silently wrong if that fallback ran.
        """
        key = (torch.get_num_threads(), *(v for w in ws for v in (w.data_ptr(), w._version)))
        if self._packed is None or self._stacked is None or key != self._key:
            self._packed = self._stacked = None  # drop the old copies before building new ones
            self._stacked = ws[0] if len(ws) == 1 else torch.cat(list(ws))
            self._packed = torch.ops.mkl._mkl_reorder_linear_weight(self._stacked, rows)
            self._key = key
        return self._packed, self._stacked

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

    def __deepcopy__(self, memo: dict[int, Any]) -> PackedWeight:
        return PackedWeight()


def usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """True when x @ w.T can take the packed GEMM: fp32 on CPU, prefill-shaped, no autograd."""
    if x.dtype != torch.float32 or w.dtype != torch.float32 or x.device.type != "cpu":
        return False
    if x.dim() == 0 or x.shape[-1] != w.shape[1] or x.numel() < MIN_ROWS * x.shape[-1]:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return False  # _mkl_linear has no backward: training keeps torch's linear
    return w.dim() == 2 and w.is_contiguous() and is_enabled()


def linear(x: torch.Tensor, w: torch.Tensor, pack: PackedWeight) -> torch.Tensor | None:
    """x @ w.T (..., N) on w's packed copy, or None where `usable` says no (caller uses torch)."""
    return stacked_linear(x, [w], pack)


def stacked_linear(
    x: torch.Tensor, ws: Sequence[torch.Tensor], pack: PackedWeight
) -> torch.Tensor | None:
    """x @ cat(ws).T (..., sum N): several linears sharing x as one GEMM on one packed copy;
    None where `usable` says no for any of them."""
    if not ws or not all(usable(x, w) for w in ws):
        return None
    rows = x.numel() // x.shape[-1]
    packed, stacked = pack.get(ws, rows)
    # prepack_batch_size = rows: _mkl_linear takes the packed path only when they are equal.
    return torch.ops.mkl._mkl_linear(x, packed, stacked, None, rows)
