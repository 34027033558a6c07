"""Mixture-of-experts MLP: a softmax top-k router over SwiGLU experts, plus optional shared experts.

Routing follows Mixtral and Qwen3-MoE: softmax over all experts, keep the top k, renormalise the
kept weights. `route` and `combine` are separate so a second flow can reuse (replay) the
primary's expert indices with its own gate weights (Dual-Flow, shared/design/dual_flow.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitphase.kernels import elementwise
from splitphase.model.config import ModelConfig
from splitphase.model.layers import SwiGLU


class MoE(nn.Module):
    """Top-k routed experts with stacked weights (E, ...) and an optional shared SwiGLU."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        e, d, f = cfg.n_experts, cfg.d_model, cfg.d_expert
        self.top_k = cfg.top_k
        self.router = nn.Linear(d, e, bias=False, dtype=dtype)
        self.gate = nn.Parameter(torch.empty(e, f, d, dtype=dtype))
        self.up = nn.Parameter(torch.empty(e, f, d, dtype=dtype))
        self.down = nn.Parameter(torch.empty(e, d, f, dtype=dtype))
        shared_width = cfg.n_shared_experts * f
        self.shared = SwiGLU(d, shared_width, dtype) if shared_width else None
        for w in (self.gate, self.up, self.down):
            nn.init.normal_(w, std=0.02)

    def route(self, x: torch.Tensor, top_k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k (weights, expert indices), each (N, k), for tokens x (N, D)."""
        k = top_k or self.top_k
        probs = F.softmax(self.router(x).float(), dim=-1)  # (N, E)
        weights, indices = probs.topk(k, dim=-1)  # (N, k)
        return (weights / weights.sum(-1, keepdim=True)).to(x.dtype), indices

    def replay_weights(self, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Gate weights for given expert indices (N, k): a softmax of x's own router logits."""
        logits = self.router(x).float().gather(-1, indices)  # (N, k)
        return F.softmax(logits, dim=-1).to(x.dtype)

    def combine(
        self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor
    ) -> torch.Tensor:
        """Weighted sum of the chosen experts' outputs (plus shared experts) for x (N, D)."""
        out = torch.zeros_like(x)
        for expert in indices.unique().tolist():
            token_idx, slot = (indices == expert).nonzero(as_tuple=True)
            h = x[token_idx]  # (n, D)
            u = elementwise.silu_mul(h @ self.gate[expert].T, h @ self.up[expert].T)  # (n, F_e)
            y = u @ self.down[expert].T  # (n, D)
            out.index_add_(0, token_idx, y * weights[token_idx, slot, None])
        if self.shared is not None:
            out = out + self.shared(x)
        return out

    def forward(self, x: torch.Tensor, top_k: int | None = None) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, D)
        weights, indices = self.route(flat, top_k)
        return self.combine(flat, weights, indices).reshape(shape)
