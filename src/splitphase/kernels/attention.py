"""Decode attention straight from a KV pool: the native kernel, or gather + SDPA in torch.

One query token per sequence attends to its own context, given as slots into a pool of
shape (N, G, D). The native kernel reads each context's K and V rows once for the whole GQA
group, in place; the torch path gathers a padded (B, S, G, D) copy first and masks it.
"""

from __future__ import annotations

import torch

from splitphase.kernels import skinny
from splitphase.model.layers import sdpa_gqa

# The pool dtypes the native kernel reads (widened to fp32 as it goes), whatever q's dtype.
NATIVE_POOL_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)


def decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """q (B, H, D) over k/v pools (N, G, D) at slots (B, S) (first lengths[b] real) -> (B, H, D).

    `mask` (B, 1, 1, S), True at real slots, saves the torch path rebuilding it.
    """
    if _native_ok(q, k_pool, v_pool):
        return torch.ops.splitphase.decode_attention(q, k_pool, v_pool, slots, lengths)
    if mask is None:
        mask = (torch.arange(slots.shape[1], device=q.device) < lengths[:, None])[:, None, None]
    kd, vd = k_pool[slots].to(q.dtype), v_pool[slots].to(q.dtype)  # (B, S, G, D) each
    out = sdpa_gqa(q[:, :, None], kd.transpose(1, 2), vd.transpose(1, 2), mask, False)
    return out[:, :, 0]  # (B, H, D)


def _native_ok(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
    if q.device.type != "cpu" or q.dtype not in (torch.float32, torch.bfloat16):
        return False
    if torch.is_grad_enabled() and q.requires_grad:
        return False
    # The pool's dtype may be narrower than q's (kv_cache_dtype): the kernel reads either.
    pool_ok = k_pool.dtype == v_pool.dtype and k_pool.dtype in NATIVE_POOL_DTYPES
    return pool_ok and k_pool.is_contiguous() and v_pool.is_contiguous() and skinny.is_enabled()
