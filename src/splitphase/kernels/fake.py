"""Fake (meta) implementations of the native ops a compiled model region reaches.

torch.compile traces with fake tensors: shapes, dtypes and strides, no data. An op defined in
C++ alone has no such rule, so dynamo would break the graph at every call. These mirror the
C++ outputs' layout exactly (`at::empty_like` of a contiguous input, or a fresh contiguous
tensor), which tests/kernels/test_fake.py checks against the real ops.
"""

from __future__ import annotations

import torch


def _skinny_linear(
    x: torch.Tensor, ws: list[torch.Tensor], pass_rows: int = 0
) -> list[torch.Tensor]:
    return [x.new_empty((x.shape[0], w.shape[0])) for w in ws]  # (rows, N_j) each


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x)


def _add_rms_norm(
    x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape)  # contiguous, whatever x's row stride (a Q/K/V slice)


def _silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(g)


_FAKES = {
    "skinny_linear": _skinny_linear,
    "rms_norm": _rms_norm,
    "add_rms_norm": _add_rms_norm,
    "rope": _rope,
    "silu_mul": _silu_mul,
}


def register() -> None:
    """Register every fake once the library is loaded (the ops exist only then)."""
    for name, fn in _FAKES.items():
        torch.library.register_fake(f"splitphase::{name}")(fn)
