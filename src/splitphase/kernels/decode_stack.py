"""A decode pass through all decoder layers in one native call, or None (run the layers).

At batch 1 the ~15 ops of a decoder layer each cost Python and dispatcher time comparable to
their arithmetic on small activations; the native `decode_layers` runs the same kernels in
the same order from C++, so its output is bit-identical to the per-op path (which stays the
fallback and, with the native kernels off, the torch reference). Past the skinny kernel's rows
its linears run on the per-op path's own oneDNN-packed copies (`bench/decode_ab.py --blocks`,
base-125m on the AMD host: 0.93-0.95x the per-op path's step at 5-32 rows in fp32, 0.85-0.94x
in bf16); where the packed GEMM is MKL's the per-op path runs those steps instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitphase.kernels import skinny
from splitphase.kernels.attention import NATIVE_POOL_DTYPES
from splitphase.kernels.switch import Switch, switch_functions


@dataclass(frozen=True)
class DecodePlan:
    """Where one single-token-per-row pass writes and reads K/V, as pool slots."""

    k_cache: torch.Tensor  # (L, N, G, D): every layer's pool
    v_cache: torch.Tensor  # (L, N, G, D)
    write_slots: torch.Tensor  # (B,) slot of each row's new K/V
    slots: torch.Tensor  # (B, S) context slots per row, the new one included (padded)
    lengths: torch.Tensor  # (B,) real slots per row


_SWITCH = Switch()


set_enabled, switched, is_enabled = switch_functions(
    _SWITCH, requires=skinny.is_enabled, module=__name__,
    set_doc="Turn the one-call decode pass on or off (the per-op path runs when off).",
    switched_doc="The one-call decode pass on (or off) inside the block, as it was after it.",
    enabled_doc="True when the fused pass is on and the native kernels are usable.",
)


def usable(x: torch.Tensor, weights: list[torch.Tensor], plan: DecodePlan) -> bool:
    """Whether the native pass covers these tensors (CPU, fp32/bf16, no autograd)."""
    if x.device.type != "cpu" or x.dtype not in skinny.MAX_ROWS or not is_enabled():
        return False
    if torch.is_grad_enabled() and any(w.requires_grad for w in weights):
        return False
    pools = (plan.k_cache, plan.v_cache)  # not necessarily the model's dtype
    if plan.v_cache.dtype != plan.k_cache.dtype or plan.k_cache.dtype not in NATIVE_POOL_DTYPES:
        return False
    return all(t.is_contiguous() for t in pools) and all(
        w.dtype == x.dtype and w.is_contiguous() for w in weights)


def decode_layers(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    final_norm: torch.Tensor,
    plan: DecodePlan,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    n_heads: int,
    packed: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """x (B, d_model) through every layer (9 weights each, see decode_stack.cpp), writing
    K/V into the plan's caches; cos/sin (B or 1, head_dim). Returns the final norm's output
    (B, d_model). packed: past the skinny kernel's rows, oneDNN's packed copies (5 a layer:
    Q/K/V stacked, O, gate, up, down) the linears run on; without them, torch's linear."""
    return torch.ops.splitphase.decode_layers(
        x, weights, final_norm, plan.k_cache, plan.v_cache, plan.write_slots, plan.slots,
        plan.lengths, cos, sin, eps, skinny.max_rows(x.dtype), n_heads, packed or [],
    )
