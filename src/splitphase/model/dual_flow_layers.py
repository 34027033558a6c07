"""Per-layer Dual-Flow computation: the primary step with its coupling taps, the auxiliary step,
and the grouped step that runs both flows' rows through each shared matrix at once.

Spec: shared/design/dual_flow.md, section 4. Coupling is one-way (primary to auxiliary):
`q_aux += a * q_pri` on the projected query (before the Qwen3 q-norm and RoPE, both flows being
at the same position), `u_aux += b * u_pri` on the MLP intermediate, `m_aux += c * m_pri` on the
MLP output. For MoE layers the routed experts' intermediates are not comparable across flows
(different experts), so `b` couples the shared experts' intermediate (width
n_shared_experts * d_expert) and does not exist without shared experts; `c` couples the whole
MoE output (routed + shared).

The primary step does exactly the operations of `DecoderLayer.forward`, in the same order, so
the primary flow is bit-identical to the baseline `Transformer` with the same weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from splitphase.kernels import elementwise
from splitphase.model.attention_context import (
    AttentionContext,
    AuxAttentionContext,
    AuxSelfKVContext,
)
from splitphase.model.config import ModelConfig
from splitphase.model.layers import Attention, SwiGLU
from splitphase.model.moe import MoE
from splitphase.model.transformer import DecoderLayer


def coupling_b_width(cfg: ModelConfig) -> int:
    """Width of the MLP-intermediate coupling b: d_ff (dense) or the shared experts' width (MoE)."""
    return cfg.n_shared_experts * cfg.d_expert if cfg.is_moe else cfg.d_ff


class Coupling(nn.Module):
    """Per-layer one-way coupling vectors a (H*d), b (MLP intermediate), c (D); zero at init.

    A vector that the coupling mode turns off is not created (None), so parameter counts match
    the audit's.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        on = cfg.coupling != "none"
        b_width = coupling_b_width(cfg) if cfg.coupling == "abc" else 0
        self.a = nn.Parameter(torch.zeros(cfg.q_dim, dtype=dtype)) if on else None
        self.b = nn.Parameter(torch.zeros(b_width, dtype=dtype)) if b_width else None
        self.c = nn.Parameter(torch.zeros(cfg.d_model, dtype=dtype)) if on else None

    @staticmethod
    def add(x: torch.Tensor, vec: nn.Parameter | None, pri: torch.Tensor | None) -> torch.Tensor:
        """x + vec * pri, or x when that coupling is off."""
        if vec is None or pri is None:
            return x
        return x + vec * pri


class Taps(NamedTuple):
    """What the auxiliary step reads from the primary at the same positions."""

    q: torch.Tensor  # (B, T, H*D) projected query, before q-norm and RoPE
    u: torch.Tensor | None  # (B, T, F_b) MLP intermediate (MoE: shared experts'), None if absent
    m: torch.Tensor  # (B, T, D) MLP output
    experts: torch.Tensor | None  # (B, T, k1) the primary's expert indices (MoE), for replay

    def last(self, n: int) -> Taps:
        """The taps of the last n positions."""
        u = None if self.u is None else self.u[:, -n:]
        experts = None if self.experts is None else self.experts[:, -n:]
        return Taps(self.q[:, -n:], u, self.m[:, -n:], experts)


@dataclass(frozen=True)
class RoutingRecord:
    """One flow's expert choice in one layer: experts (N, k), N tokens of that flow."""

    layer_idx: int
    flow: str  # "primary" | "aux"
    experts: torch.Tensor


@dataclass(frozen=True)
class FlowSettings:
    """Inference-time knobs of one pass (the model's attributes, validated)."""

    primary_top_k: int
    aux_top_k: int
    replay: bool
    aux_self_kv: bool
    trace: list[RoutingRecord] | None = None

    def record(self, layer_idx: int, flow: str, experts: torch.Tensor) -> None:
        if self.trace is not None:
            self.trace.append(RoutingRecord(layer_idx, flow, experts.detach()))


def split_rows(fn: Callable[..., torch.Tensor], n: int, *xs: torch.Tensor) -> torch.Tensor:
    """fn over rows [:n] and rows [n:] of each x separately, concatenated along rows.

    Why: ATen runs elementwise ops on whole SIMD vectors plus a scalar loop for the tail, and
    the two round transcendental functions (the exp in SiLU) differently. Applied to one flow's
    rows at a time, the primary's elements take the code path of an ungrouped pass, so grouping
    stays bit-identical wherever the GEMMs are row-count invariant. Only GEMMs read weights, so
    only they need the concatenated rows.
    """
    if n in (0, xs[0].shape[0]):
        return fn(*xs)
    return torch.cat([fn(*(x[:n] for x in xs)), fn(*(x[n:] for x in xs))])


def swiglu_act(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, the arithmetic of `SwiGLU.intermediate`."""
    return elementwise.silu_mul(gate, up)


# ---------------------------------------------------------------- MoE pieces


def top_k_route(
    logits: torch.Tensor, k: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, indices) (N, k) from router logits (N, E), as `MoE.route` computes them."""
    probs = F.softmax(logits.float(), dim=-1)  # (N, E)
    weights, indices = probs.topk(k, dim=-1)  # (N, k)
    return (weights / weights.sum(-1, keepdim=True)).to(dtype), indices


def replay_route(logits: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gate weights (N, k) for given indices from the aux's own logits (`MoE.replay_weights`)."""
    return F.softmax(logits.float().gather(-1, indices), dim=-1).to(dtype)


def expert_mix(
    moe: MoE,
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    rows: torch.Tensor,
    n_primary: int | None = None,
) -> torch.Tensor:
    """Routed-expert output (R, D) for rows x (R, D); choice j is (rows[j], indices[j], weights[j]).

    Each chosen expert runs once over all its rows, whichever flow they belong to, so its weights
    are read once per step. Rows below n_primary are the primary's and come first in the choices.
    Same arithmetic as `MoE.combine` without the shared experts.
    """
    out = torch.zeros_like(x)
    for expert in indices.unique().tolist():
        sel = (indices == expert).nonzero(as_tuple=True)[0]
        token_idx = rows[sel]  # primary rows first, then aux rows
        h = x[token_idx]  # (n, D)
        n_pri = len(token_idx) if n_primary is None else int((token_idx < n_primary).sum())
        u = split_rows(swiglu_act, n_pri, h @ moe.gate[expert].T, h @ moe.up[expert].T)  # (n, F_e)
        y = u @ moe.down[expert].T  # (n, D)
        out.index_add_(0, token_idx, y * weights[sel, None])
    return out


def _choices(
    weights: torch.Tensor, indices: torch.Tensor, offset: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flatten (N, k) choices row-major into (weights, indices, rows), rows shifted by offset."""
    rows = torch.arange(indices.shape[0], device=indices.device) + offset  # (N,)
    rows = rows[:, None].expand_as(indices)  # (N, k)
    return weights.flatten(), indices.flatten(), rows.flatten()


def moe_grouped(
    moe: MoE,
    cp: Coupling | None,
    y1: torch.Tensor,
    y2: torch.Tensor,
    s: FlowSettings,
    layer_idx: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """One MoE pass over the primary rows y1 (N, D) and the aux rows y2 (N or 0, D), row i of y2
    being the aux at the same position as row i of y1; returns (m1, m2, u1_shared, experts1).

    With y2 empty (and cp None) it is the primary alone, the arithmetic of `MoE.forward`.
    """
    b_vec, c_vec = (None, None) if cp is None else (cp.b, cp.c)
    n1 = y1.shape[0]
    y = torch.cat([y1, y2]) if y2.shape[0] else y1  # (N1+N2, D)
    logits = moe.router(y)  # (N1+N2, E): one router read for both flows
    w1, i1 = top_k_route(logits[:n1], s.primary_top_k, y.dtype)
    s.record(layer_idx, "primary", i1)
    parts = [_choices(w1, i1, 0)]
    if y2.shape[0]:
        if s.replay:  # the primary's experts, the aux's own gate weights
            w2, i2 = replay_route(logits[n1:], i1, y.dtype), i1
        else:
            w2, i2 = top_k_route(logits[n1:], s.aux_top_k, y.dtype)
        s.record(layer_idx, "aux", i2)
        parts.append(_choices(w2, i2, n1))
    w, i, rows = (torch.cat(p) for p in zip(*parts, strict=True))
    routed = expert_mix(moe, y, w, i, rows, n1)  # (N1+N2, D)
    u1: torch.Tensor | None = None
    m = routed
    if moe.shared is not None:
        u = split_rows(swiglu_act, n1, moe.shared.gate_proj(y), moe.shared.up_proj(y))
        u1 = u[:n1]
        u_both = torch.cat([u1, Coupling.add(u[n1:], b_vec, u1)]) if y2.shape[0] else u
        m = routed + moe.shared.down_proj(u_both)  # (N1+N2, D)
    return m[:n1], Coupling.add(m[n1:], c_vec, m[:n1]), u1, i1


def moe_aux(
    moe: MoE, cp: Coupling, y2: torch.Tensor, taps: Taps, s: FlowSettings, layer_idx: int
) -> torch.Tensor:
    """The aux flow's MoE output (N, D) for rows y2 (N, D), reading the primary's taps (N, ...)."""
    logits = moe.router(y2)  # (N, E)
    if s.replay:
        assert taps.experts is not None
        i2 = taps.experts.reshape(-1, taps.experts.shape[-1])  # (N, k1)
        w2 = replay_route(logits, i2, y2.dtype)
    else:
        w2, i2 = top_k_route(logits, s.aux_top_k, y2.dtype)
    s.record(layer_idx, "aux", i2)
    m = expert_mix(moe, y2, *_choices(w2, i2, 0))  # (N, D)
    if moe.shared is not None:
        u_pri = None if taps.u is None else taps.u.reshape(-1, taps.u.shape[-1])  # (N, F_s)
        m = m + moe.shared.down_proj(cp.add(moe.shared.intermediate(y2), cp.b, u_pri))
    return cp.add(m, cp.c, taps.m.reshape(m.shape))


# ---------------------------------------------------------------- one layer, per flow


def aux_attend(
    ctx: AuxAttentionContext,
    layer_idx: int,
    attn: Attention,
    q: torch.Tensor,
    self_kv: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """The aux query's read-only attention (B, A, H*D), with its own uncached K/V if given."""
    if self_kv is None:
        return ctx.attend_cached(layer_idx, attn, q)
    if not isinstance(ctx, AuxSelfKVContext):
        raise TypeError(
            f"aux_self_kv=True needs an attention context with attend_cached_self_kv; "
            f"{type(ctx).__name__} has none (KVCache and the teacher-forced context do)"
        )
    return ctx.attend_cached_self_kv(layer_idx, attn, q, *self_kv)


def primary_layer(
    layer: DecoderLayer,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    ctx: AttentionContext,
    s: FlowSettings,
) -> tuple[torch.Tensor, Taps]:
    """The baseline layer on the primary stream x (B, T, D), op for op; also returns its taps."""
    attn = layer.self_attn
    h = layer.input_layernorm(x)
    q_flat = attn.q_proj(h)  # (B, T, H*D)
    k, v = attn.project_kv(h, cos, sin)  # (B, T, G, D)
    x = x + attn.o_proj(ctx.attend(layer.layer_idx, attn, attn.rotate_q(q_flat, cos, sin), k, v))
    y = layer.post_attention_layernorm(x)
    if isinstance(layer.mlp, MoE):
        flat = y.reshape(-1, y.shape[-1])  # (B*T, D)
        m, _, u, experts = moe_grouped(layer.mlp, None, flat, flat[:0], s, layer.layer_idx)
        m, experts = m.reshape(y.shape), experts.unflatten(0, y.shape[:2])  # (B, T, D), (B, T, k)
        u = None if u is None else u.unflatten(0, y.shape[:2])  # (B, T, F_s)
    else:
        assert isinstance(layer.mlp, SwiGLU)
        u, experts = layer.mlp.intermediate(y), None  # (B, T, F)
        m = layer.mlp.down_proj(u)  # (B, T, D)
    return x + m, Taps(q_flat, u, m, experts)


def aux_layer(
    layer: DecoderLayer,
    cp: Coupling,
    x: torch.Tensor,
    taps: Taps,
    cos: torch.Tensor,
    sin: torch.Tensor,
    ctx: AuxAttentionContext,
    s: FlowSettings,
) -> torch.Tensor:
    """The aux stream x (B, A, D) at the pass's last A positions, after the primary wrote K/V."""
    attn = layer.self_attn
    h = layer.input_layernorm(x)  # shared norms (share_norms=True)
    q = attn.rotate_q(cp.add(attn.q_proj(h), cp.a, taps.q), cos, sin)  # (B, A, H, D)
    self_kv = attn.project_kv(h, cos, sin) if s.aux_self_kv else None  # never stored
    x = x + attn.o_proj(aux_attend(ctx, layer.layer_idx, attn, q, self_kv))
    y = layer.post_attention_layernorm(x)
    if isinstance(layer.mlp, MoE):
        m = moe_aux(layer.mlp, cp, y.reshape(-1, y.shape[-1]), taps, s, layer.layer_idx)
        return x + m.reshape(y.shape)
    assert isinstance(layer.mlp, SwiGLU)
    u = cp.add(layer.mlp.intermediate(y), cp.b, taps.u)  # (B, A, F)
    return x + cp.add(layer.mlp.down_proj(u), cp.c, taps.m)


def grouped_layer(
    layer: DecoderLayer,
    cp: Coupling,
    x1: torch.Tensor,
    x2: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    ctx: AuxAttentionContext,
    s: FlowSettings,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both flows at one decode position, x1 and x2 (B, 1, D): rows [x1; x2] share each GEMM."""
    attn, n = layer.self_attn, x1.shape[0]
    h = torch.cat([layer.input_layernorm(x1), layer.input_layernorm(x2)])  # (2B, 1, D)
    q_flat = attn.q_proj(h)  # (2B, 1, H*D): W_q read once for both flows
    q1 = attn.rotate_q(q_flat[:n], cos, sin)  # (B, 1, H, D)
    q2 = attn.rotate_q(cp.add(q_flat[n:], cp.a, q_flat[:n]), cos, sin)  # (B, 1, H, D)
    k, v = attn.project_kv(h if s.aux_self_kv else h[:n], cos, sin)  # (B or 2B, 1, G, D)
    out1 = ctx.attend(layer.layer_idx, attn, q1, k[:n], v[:n])  # writes the primary K/V at t
    self_kv = (k[n:], v[n:]) if s.aux_self_kv else None
    out2 = aux_attend(ctx, layer.layer_idx, attn, q2, self_kv)  # over cache[:t+1]
    x = torch.cat([x1, x2]) + attn.o_proj(torch.cat([out1, out2]))  # (2B, 1, D)
    y = split_rows(layer.post_attention_layernorm, n, x)  # (2B, 1, D)
    if isinstance(layer.mlp, MoE):
        flat = y.reshape(-1, y.shape[-1])  # (2B, D)
        m1, m2, _, _ = moe_grouped(layer.mlp, cp, flat[:n], flat[n:], s, layer.layer_idx)
        return x[:n] + m1.reshape(x1.shape), x[n:] + m2.reshape(x2.shape)
    assert isinstance(layer.mlp, SwiGLU)
    mlp = layer.mlp
    u = split_rows(swiglu_act, n, mlp.gate_proj(y), mlp.up_proj(y))  # (2B, 1, F)
    m = mlp.down_proj(torch.cat([u[:n], cp.add(u[n:], cp.b, u[:n])]))  # (2B, 1, D)
    return x[:n] + m[:n], x[n:] + cp.add(m[n:], cp.c, m[:n])
