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


def _ok(*ts: torch.Tensor, strided: torch.Tensor | None = None) -> bool:
    """The native pass applies: CPU, one supported dtype, no autograd, contiguous inputs (and
    `strided`, if given, in the rows-of-heads layout rope reads in place)."""
    first = ts[0]
    if first.device.type != "cpu" or first.dtype not in _DTYPES:
        return False
    every = ts if strided is None else (*ts, strided)
    if torch.is_grad_enabled() and any(t.requires_grad for t in every):
        return False
    if strided is not None and not (strided.is_contiguous() or _rows_of_heads(strided)):
        return False
    return all(t.dtype == first.dtype and t.device == first.device for t in every) and all(
        t.is_contiguous() for t in ts
    ) and skinny.is_enabled()


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


def add_rms_norm_(
    x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """As add_rms_norm, the sum written over r (a block's output nobody reads again): the pass
    writes to lines it has just read, where a fresh buffer's are fetched from memory first."""
    if x.shape != r.shape or not _ok(x, r, weight) or torch.compiler.is_compiling():
        return add_rms_norm(x, r, weight, eps)
    s, y = torch.ops.splitphase.add_rms_norm_(x, r, weight, eps)
    return s, y


def _rows_of_heads(x: torch.Tensor) -> bool:
    """x (B, T, H, D) whose (b, t) rows hold H*D contiguous values a fixed stride apart: a
    slice of a fused Q/K/V projection's output, which the native rope reads in place. With
    T = 1 (decode) the rows are the batch's, whatever stride torch gives the size-1 dim."""
    b, t, h, d = x.shape
    if x.stride(3) != 1 or x.stride(2) != d:
        return False
    row = x.stride(0) if t == 1 else x.stride(1)
    return row >= h * d and (t == 1 or x.stride(0) == t * x.stride(1))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """x (B, T, H, D) rotated by cos/sin (B or 1, T, 1, D), contiguous, or None (use torch)."""
    if x.dim() != 4 or cos.dim() != 4 or cos.shape[2] != 1:
        return None
    c, s = cos.squeeze(2), sin.squeeze(2)  # (B or 1, T, D)
    if c.shape[0] not in (1, x.shape[0]) or c.shape[1] != x.shape[1] or not _ok(c, s, strided=x):
        return None
    return torch.ops.splitphase.rope(x, c, s)


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) * u; natively one pass whose elements do not depend on their position (torch's
    vector loop ends in a scalar one that rounds exp differently, so a row's result there
    depends on how many rows share the call)."""
    if g.shape == u.shape and _ok(g, u):
        return torch.ops.splitphase.silu_mul(g, u)
    return F.silu(g) * u


def silu_mul_(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) * u, natively written over g (a projection's output nobody reads again), whose
    lines the pass has just read, where a fresh buffer's are fetched from memory first
    (bench/prefill_budget.py, base-125m, 512 tokens: SiLU*mul 6.0 ms into fresh buffers, 3.0
    over g)."""
    if g.shape == u.shape and _ok(g, u) and not torch.compiler.is_compiling():
        return torch.ops.splitphase.silu_mul_(g, u)
    return silu_mul(g, u)
