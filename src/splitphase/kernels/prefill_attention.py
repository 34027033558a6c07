"""Causal prefill attention on CPU: the native flash-style kernel, or None (use torch SDPA).

Queries are the last T of a sequence's S positions (T = S for a whole prompt, T < S for a
chunk after a cached prefix). The kernel tiles queries and keys, keeps a running softmax,
skips key tiles above the diagonal and reads each K/V tile once for all the query heads of
its group (GQA), reading K/V in place: a strided view of the contiguous KV cache, or a paged
pool through slots. It computes in fp32 and covers fp32 inputs with a head_dim that is a
multiple of 16; anything else (GPU, bf16, autograd) is left to the caller's torch path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from splitphase.kernels import build, skinny

_SWITCH = build.Switch()


def set_enabled(on: bool) -> None:
    """Turn the native prefill attention on or off for this process (torch SDPA when off)."""
    _SWITCH.on = on


@contextlib.contextmanager
def switched(on: bool) -> Iterator[None]:
    """Native prefill attention on (or off) inside the block, as it was after it."""
    before = _SWITCH.on
    _SWITCH.on = on
    try:
        yield
    finally:
        _SWITCH.on = before


def is_enabled() -> bool:
    """True when this path is on and the native kernels are (SPLITPHASE_KERNELS=0 turns all off)."""
    return _SWITCH.on and skinny.is_enabled()


def _rows_ok(x: torch.Tensor) -> bool:
    """Each row's heads contiguous (H*D values, any stride between rows): what the kernel reads."""
    return x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]


def _ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    if q.device.type != "cpu" or q.dtype != torch.float32:
        return False
    if k.dtype != q.dtype or v.dtype != q.dtype or k.shape != v.shape:
        return False
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return False
    heads, dim = q.shape[-2], q.shape[-1]
    if dim % 16 or k.shape[-1] != dim or heads % k.shape[-2]:
        return False
    return _rows_ok(q) and _rows_ok(k) and _rows_ok(v) and is_enabled()


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """q (B, T, H, D), the last T positions of k/v (B, S, G, D) -> (B, T, H*D), or None."""
    if q.dim() != 4 or k.dim() != 4 or q.shape[0] != k.shape[0]:
        return None
    if not 0 < q.shape[1] <= k.shape[1] or not _ok(q, k, v):
        return None
    return torch.ops.splitphase.prefill_attention(q, k, v)


def causal_paged(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    q_rows: torch.Tensor,
    slots: torch.Tensor,
    out: torch.Tensor,
) -> bool:
    """Rows q_rows of q (N, H, D) attend causally over k/v pools (P, G, D) at slots (S,), the
    slots of their sequence's positions 0..S-1 (the queries are the last T); writes those rows
    of out (N, H*D). False when the kernel does not apply (nothing written)."""
    if q.dim() != 3 or k_pool.dim() != 3 or not 0 < q_rows.numel() <= slots.numel():
        return False
    if q_rows.dtype != torch.long or slots.dtype != torch.long:
        return False
    if not (k_pool.is_contiguous() and v_pool.is_contiguous() and out.is_contiguous()):
        return False
    if out.dtype != q.dtype or out.shape != (q.shape[0], q.shape[1] * q.shape[2]):
        return False
    if not _ok(q, k_pool, v_pool):
        return False
    torch.ops.splitphase.prefill_attention_paged(q, k_pool, v_pool, q_rows, slots, out)
    return True
