"""Building blocks of a Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Module and parameter names follow Hugging Face's Llama (`self_attn.q_proj`, `mlp.gate_proj`, ...)
so a local HF checkpoint maps onto ours by dropping the `model.` prefix. The attention module
exposes its projections and its output separately: the paged engine and the Dual-Flow model
reuse the same weights with their own K/V handling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from splitphase.kernels import elementwise, packed_linear, prefill_attention, skinny
from splitphase.model.config import ModelConfig


class Linear(nn.Linear):
    """nn.Linear whose decode-shaped calls (a few rows, no bias) take the native kernel and
    whose prefill-shaped fp32 calls take MKL's GEMM on a packed copy of the weight."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.packed = packed_linear.PackedWeight()  # filled by the first prefill-shaped call

    def _apply(self, fn: Any, recurse: bool = True) -> Linear:
        self.packed = packed_linear.PackedWeight()  # .to(), .float(): drop the old copy now
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return project(x, self)[0]
        return super().forward(x)

    def packed_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """x @ weight.T on the packed weight, or None where that path does not apply."""
        return None if self.bias is not None else packed_linear.linear(x, self.weight, self.packed)


def project(x: torch.Tensor, *linears: Linear) -> tuple[torch.Tensor, ...]:
    """x through bias-free linears that share it: packed GEMMs in prefill, one native pass
    over all the weights in decode (Q/K/V; gate/up), torch otherwise."""
    out = [lin.packed_forward(x) for lin in linears]
    if all(y is not None for y in out):
        return tuple(cast(list[torch.Tensor], out))
    return skinny.linears(x, *(lin.weight for lin in linears))


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 whatever the weight dtype (as HF Llama does)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = elementwise.rms_norm(x, self.weight, self.eps)
        if fused is not None:
            return fused
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def residual(self, x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + r, this norm of it): a residual add and the norm after it, one pass natively.
        r is a block's output, a temporary: the native pass writes x + r over it."""
        fused = elementwise.add_rms_norm_(x, r, self.weight, self.eps)
        if fused is not None:
            return fused
        s = x + r
        return s, self(s)


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1's "llama3" frequency scaling (factor 1 = plain RoPE)."""

    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_len: int = 0

    @classmethod
    def of(cls, cfg: ModelConfig) -> RopeScaling:
        return cls(cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
                   cfg.rope_original_max_len)


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Long wavelengths (beyond the original context) slow down by `factor`; short ones stay;
    # the band between is interpolated (Meta's Llama 3.1 reference, as transformers does it).
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = s.original_max_len / s.low_freq_factor
    high_wavelen = s.original_max_len / s.high_freq_factor
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_len / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
    scaling: RopeScaling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for the given positions, HF "rotate_half" layout: (..., head_dim)."""
    inv_freq = 1.0 / (
        theta
        ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    )
    if scaling is not None and scaling.factor > 1.0:
        inv_freq = _llama3_scale(inv_freq, scaling)
    freqs = positions.to(torch.float32)[..., None] * inv_freq  # (..., head_dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (..., head_dim)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x of shape (B, T, heads, D) by position; cos/sin broadcast as (B or 1, T, 1, D)."""
    fused = elementwise.rope(x, cos, sin)
    if fused is not None:
        return fused
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Grouped-query attention; K/V storage is the caller's business."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = Linear(cfg.d_model, cfg.q_dim, bias=False, dtype=dtype)
        self.k_proj = Linear(cfg.d_model, cfg.kv_dim, bias=False, dtype=dtype)
        self.v_proj = Linear(cfg.d_model, cfg.kv_dim, bias=False, dtype=dtype)
        self.o_proj = Linear(cfg.q_dim, cfg.d_model, bias=False, dtype=dtype)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, dtype) if cfg.qk_norm else None
        self.qkv_packed = packed_linear.PackedWeight()  # Q/K/V stacked: one prefill GEMM

    def _apply(self, fn: Any, recurse: bool = True) -> Attention:
        self.qkv_packed = packed_linear.PackedWeight()
        return super()._apply(fn, recurse)

    def project_q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotated queries (B, T, H, D)."""
        return self.rotate_q(self.q_proj(x), cos, sin)

    def rotate_q(self, q_flat: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Reshape projected queries (B, T, H*D) to heads, norm (Qwen3) and rotate."""
        q = q_flat.unflatten(-1, (self.n_heads, self.head_dim))  # (B, T, H, D)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rope(q, cos, sin)

    def project_kv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated keys and values (B, T, G, D)."""
        k, v = project(x, self.k_proj, self.v_proj)  # (B, T, G*D) each
        return self.rotate_kv(k, v, cos, sin)

    def rotate_kv(
        self, k_flat: torch.Tensor, v_flat: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Reshape projected keys/values (B, T, G*D) to heads; norm (Qwen3) and rotate keys."""
        k = k_flat.unflatten(-1, (self.n_kv_heads, self.head_dim))  # (B, T, G, D)
        v = v_flat.unflatten(-1, (self.n_kv_heads, self.head_dim))  # (B, T, G, D)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return apply_rope(k, cos, sin), v

    def project_qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated q (B, T, H, D) and k, v (B, T, G, D) from one fused pass over the weights."""
        weights = [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]
        qkv = packed_linear.stacked_linear(x, weights, self.qkv_packed)  # (B, T, (H+2G)*D)
        if qkv is not None:  # prefill: one GEMM; q, k, v are column slices rope reads in place
            q, k, v = qkv.split([w.shape[0] for w in weights], dim=-1)
        else:
            q, k, v = project(x, self.q_proj, self.k_proj, self.v_proj)
        return (self.rotate_q(q, cos, sin), *self.rotate_kv(k, v, cos, sin))

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        causal: bool,
    ) -> torch.Tensor:
        """SDPA over q (B, T, H, D) and k/v (B, S, G, D); returns (B, T, H*D) before o_proj."""
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T|S, D)
        out = sdpa_gqa(q, k, v, mask, causal and mask is None)
        return out.transpose(1, 2).flatten(2)  # (B, T, H*D)

    def attend_causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of q (B, T, H, D), the last T of the S positions of k/v (B, S, G, D);
        returns (B, T, H*D). The native prefill kernel where it applies, else SDPA."""
        out = prefill_attention.causal(q, k, v)
        if out is not None:
            return out
        t, s = q.shape[1], k.shape[1]
        mask = None if t == s else causal_mask(t, s, q.device)  # (T, S)
        return self.attend(q, k, v, mask=mask, causal=mask is None)


def _sdpa_has_gqa() -> bool:
    return "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


_SDPA_GQA = _sdpa_has_gqa()


def sdpa_gqa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool
) -> torch.Tensor:
    """SDPA of q (B, H, T, D) over k/v (B, G, S, D) with H a multiple of G (GQA)."""
    if q.shape[1] != k.shape[1]:
        if _SDPA_GQA:  # torch >= 2.5 shares each K/V head without copying it
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True
            )
        groups = q.shape[1] // k.shape[1]  # expanding K/V to the query heads is exact GQA
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)


class SwiGLU(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, d_model: int, d_ff: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = Linear(d_model, d_ff, bias=False, dtype=dtype)
        self.up_proj = Linear(d_model, d_ff, bias=False, dtype=dtype)
        self.down_proj = Linear(d_ff, d_model, bias=False, dtype=dtype)

    def intermediate(self, x: torch.Tensor) -> torch.Tensor:
        """The gated hidden state u = silu(gate(x)) * up(x): (..., d_ff), fused in decode."""
        g, u = project(x, self.gate_proj, self.up_proj)  # (..., d_ff) each, fresh
        return elementwise.silu_mul_(g, u)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.intermediate(x))


def causal_mask(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """Boolean mask (q_len, kv_len) for queries that are the last q_len of kv_len positions."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    return torch.arange(kv_len, device=device)[None, :] <= q_pos
