"""One-pass RMSNorm, RoPE and SwiGLU's activation on CPU, or the torch reference.

In prefill these element-wise passes cost as much as a third of the step in torch (seven
tensor ops for a norm, five for a rotation, each a parallel region over the whole
activation); the native versions read and write each activation once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from splitphase.kernels import skinny

_DTYPES = (torch.float32, torch.bfloat16)


def _ok(*ts: torch.Tensor) -> bool:
    first = ts[0]
    if first.device.type != "cpu" or first.dtype not in _DTYPES:
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in ts):
        return False
    return all(t.dtype == first.dtype and t.is_contiguous() for t in ts) and skinny.is_enabled()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """weight * (x * rsqrt(mean(x**2) + eps)) over the last dim, or None (use torch)."""
    if not _ok(x, weight):
        return None
    return torch.ops.splitphase.rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(x + r, rms_norm(x + r)) in one pass (a residual add and the norm after it), or None."""
    if x.shape != r.shape or not _ok(x, r, weight):
        return None
    s, y = torch.ops.splitphase.add_rms_norm(x, r, weight, eps)
    return s, y


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """x (B, T, H, D) rotated by cos/sin (B or 1, T, 1, D), or None (use torch)."""
    if x.dim() != 4 or cos.dim() != 4 or cos.shape[2] != 1:
        return None
    c, s = cos.squeeze(2), sin.squeeze(2)  # (B or 1, T, D)
    if c.shape[0] not in (1, x.shape[0]) or c.shape[1] != x.shape[1] or not _ok(x, c, s):
        return None
    return torch.ops.splitphase.rope(x, c, s)


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) * u; natively one pass whose elements do not depend on their position (torch's
    vector loop ends in a scalar one that rounds exp differently, so a row's result there
    depends on how many rows share the call)."""
    if g.shape == u.shape and _ok(g, u):
        return torch.ops.splitphase.silu_mul(g, u)
    return F.silu(g) * u
