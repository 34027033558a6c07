"""Dual-Flow Transformer: the baseline model as the primary flow, plus an auxiliary decode flow.

Liu, Wang and Zhao, arXiv 2608.12385 (spec: shared/design/dual_flow.md, section 4). The primary
flow is the baseline `Transformer` with the same weights: the only writer of the KV cache, it
never reads auxiliary state. The auxiliary flow embeds the same token with its own table, runs
through the shared attention, MLP, norms and LM head, attends to the primary's K/V at positions
<= t with its own query (computing and caching no K/V), and is coupled one way to the primary by
zero-initialised vectors. The prediction mixes both heads' distributions:
P = alpha * p + (1 - alpha) * q, alpha = clip(sum p^2, alpha_min, 1).

Phases: `prefill` runs the primary over the prompt and the aux at the last position only;
`decode_step` runs both flows grouped (each shared matrix multiplies the rows [x_pri; x_aux]
once); `forward` is the teacher-forced pass with both flows at every position, which reproduces
inference for every prompt boundary because the aux at t reads only x_t and primary states <= t.
All three return log P, so cross-entropy on the output (softmax(log P) = P) trains -log P.
"""

from __future__ import annotations

from typing import NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import nn

from splitphase.model.attention_context import AuxAttentionContext, KVCache, attend_prefix
from splitphase.model.config import AUX_ROUTINGS, ConfigError, ModelConfig
from splitphase.model.dual_flow_layers import (
    Coupling,
    FlowSettings,
    RoutingRecord,
    Taps,
    aux_layer,
    grouped_layer,
    primary_layer,
)
from splitphase.model.layers import Attention
from splitphase.model.transformer import TORCH_DTYPES, DecoderLayer, Transformer


class FlowOutput(NamedTuple):
    """Both flows' logits, the prediction log P (fp32) and the mixing weight alpha.

    Shapes are (B, T, V) and (B, T) for a teacher-forced pass, (B, V) and (B,) for one position.
    With the aux flow disabled, logits_q is logits_p and alpha is 1 (P = p).
    """

    logits_p: torch.Tensor
    logits_q: torch.Tensor
    log_probs: torch.Tensor
    alpha: torch.Tensor


def mix_readout(
    logits_p: torch.Tensor, logits_q: torch.Tensor, readout: str, alpha_min: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log P, alpha): P = alpha p + (1 - alpha) q with alpha = clip(sum p^2, alpha_min, 1) per
    position ("mix"), or P = q ("aux"). Computed in fp32 whatever the logits' dtype."""
    log_q = F.log_softmax(logits_q.float(), dim=-1)  # (..., V)
    if readout == "aux":
        return log_q, torch.zeros(log_q.shape[:-1], device=log_q.device)
    log_p = F.log_softmax(logits_p.float(), dim=-1)  # (..., V)
    # The primary's collision probability is its confidence; alpha keeps its gradient (the spec
    # writes the loss as -log P with no stop-gradient).
    alpha = log_p.exp().pow(2).sum(-1).clamp(alpha_min, 1.0)  # (...)
    # A clamp before the log keeps log(1 - alpha) finite (and its gradient zero) at alpha == 1.
    one_minus = (1.0 - alpha).clamp_min(torch.finfo(torch.float32).tiny)
    log_mix = torch.logaddexp(log_p + alpha.log()[..., None], log_q + one_minus.log()[..., None])
    return log_mix, alpha


class StoredKV:
    """Teacher-forced context: causal self-attention that keeps each layer's K/V for the aux."""

    def __init__(self) -> None:
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def attend(
        self, layer_idx: int, attn: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self.kv[layer_idx] = (k, v)  # (B, T, G, D) each; autograd keeps them alive anyway
        return attn.attend_causal(q, k, v)

    def attend_cached(self, layer_idx: int, attn: Attention, q: torch.Tensor) -> torch.Tensor:
        return attend_prefix(attn, q, *self.kv[layer_idx])

    def attend_cached_self_kv(
        self,
        layer_idx: int,
        attn: Attention,
        q: torch.Tensor,
        k_self: torch.Tensor,
        v_self: torch.Tensor,
    ) -> torch.Tensor:
        return attend_prefix(attn, q, *self.kv[layer_idx], (k_self, v_self))


class DualFlowTransformer(Transformer):
    """A Dual-Flow LM: the baseline's weights and KV cache, plus an auxiliary decode flow.

    Inference knobs (attributes): `aux_enabled` (False runs the primary alone, P = p),
    `primary_top_k` / `aux_top_k` / `aux_routing` (MoE; default from the config),
    `routing_trace` (a list to record every layer's expert choice per flow, or None).
    """

    has_aux_flow = True

    def __init__(self, cfg: ModelConfig) -> None:
        if not cfg.is_dual_flow:
            raise ConfigError(f"DualFlowTransformer needs arch='dual_flow', got {cfg.arch!r}")
        super().__init__(cfg)  # draws the baseline's weights first: same seed, same weights
        dtype = TORCH_DTYPES[cfg.dtype]
        self.embed_aux = nn.Embedding(cfg.vocab_size, cfg.d_model, dtype=dtype)
        nn.init.normal_(self.embed_aux.weight, std=0.02)  # as embed_tokens
        self.couplings = nn.ModuleList(Coupling(cfg, dtype) for _ in range(cfg.n_layers))
        self.aux_enabled = True
        self.primary_top_k = cfg.top_k
        self.aux_top_k = cfg.aux_k
        self.aux_routing = cfg.aux_routing
        self.routing_trace: list[RoutingRecord] | None = None

    def flow_settings(self) -> FlowSettings:
        """The current inference knobs, checked."""
        if self.aux_routing not in AUX_ROUTINGS:
            raise ValueError(f"aux_routing must be one of {AUX_ROUTINGS}, got {self.aux_routing!r}")
        if self.cfg.is_moe:
            for name in ("primary_top_k", "aux_top_k"):
                k = getattr(self, name)
                if not 1 <= k <= self.cfg.n_experts:
                    raise ValueError(f"{name} must be in [1, {self.cfg.n_experts}], got {k}")
        return FlowSettings(
            primary_top_k=self.primary_top_k,
            aux_top_k=self.aux_top_k,
            replay=self.aux_routing == "replay",
            aux_self_kv=self.cfg.aux_self_kv,
            trace=self.routing_trace,
        )

    def blocks(self) -> list[tuple[DecoderLayer, Coupling]]:
        """(shared layer, its coupling) per depth."""
        pairs = zip(self.layers, self.couplings, strict=True)
        return [(cast(DecoderLayer, layer), cast(Coupling, cp)) for layer, cp in pairs]

    def run_flows(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: AuxAttentionContext,
        aux_positions: int,
        grouped: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Final-normed hidden states: primary (B, T, D) for ids (B, T), aux (B, A, D) at the
        last A = aux_positions positions (None when the aux is disabled or A is 0).

        `grouped` (decode, T == A == 1) runs both flows' rows through each shared matrix at once.
        Otherwise two passes: the primary over all layers (writing K/V), then the aux.
        """
        s = self.flow_settings()
        cos, sin = self.rope(positions)  # (B or 1, T, 1, D)
        n_aux = aux_positions if self.aux_enabled else 0
        if grouped and n_aux:
            if ids.shape[1] != 1 or n_aux != 1:
                raise ValueError("grouped execution is for decode: one token and one aux row")
            x, xa = self.embed_tokens(ids), self.embed_aux(ids)  # (B, 1, D) each
            for layer, cp in self.blocks():
                x, xa = grouped_layer(layer, cp, x, xa, cos, sin, ctx, s)
            return self.norm(x), self.norm(xa)
        x = self.embed_tokens(ids)  # (B, T, D)
        taps: list[Taps] = []
        for layer, _ in self.blocks():
            x, layer_taps = primary_layer(layer, x, cos, sin, ctx, s)
            if n_aux:
                taps.append(layer_taps.last(n_aux))  # only the aux positions are kept
        if not n_aux:
            return self.norm(x), None
        xa = self.embed_aux(ids[:, -n_aux:])  # (B, A, D)
        cos_a, sin_a = cos[:, -n_aux:], sin[:, -n_aux:]  # (B or 1, A, 1, D)
        for (layer, cp), layer_taps in zip(self.blocks(), taps, strict=True):
            xa = aux_layer(layer, cp, xa, layer_taps, cos_a, sin_a, ctx, s)
        return self.norm(x), self.norm(xa)

    def flow_outputs(
        self, hidden_p: torch.Tensor, hidden_q: torch.Tensor | None, grouped: bool
    ) -> FlowOutput:
        if hidden_q is None:  # aux off: the prediction is the primary's
            logits_p = self.logits(hidden_p)
            alpha = torch.ones(logits_p.shape[:-1], device=logits_p.device)
            return FlowOutput(logits_p, logits_p, F.log_softmax(logits_p.float(), -1), alpha)
        if grouped:  # one read of the LM head for both flows' rows
            both = self.logits(torch.cat([hidden_p, hidden_q]))  # (2B, ..., V)
            logits_p, logits_q = both.chunk(2)
        else:
            logits_p, logits_q = self.logits(hidden_p), self.logits(hidden_q)
        log_probs, alpha = mix_readout(logits_p, logits_q, self.cfg.readout, self.cfg.alpha_min)
        return FlowOutput(logits_p, logits_q, log_probs, alpha)

    def forward_flows(self, ids: torch.Tensor) -> FlowOutput:
        """Teacher-forced pass, both flows at every position: logits (B, T, V), alpha (B, T)."""
        positions = torch.arange(ids.shape[1], device=ids.device)
        hidden_p, hidden_q = self.run_flows(ids, positions, StoredKV(), ids.shape[1])
        return self.flow_outputs(hidden_p, hidden_q, grouped=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Teacher-forced log P (B, T, V), fp32: cross-entropy on it is -log P(y)."""
        return self.forward_flows(ids).log_probs

    def _cached_flows(self, ids: torch.Tensor, cache: KVCache, grouped: bool) -> FlowOutput:
        cache.begin(ids.shape[1])
        positions = torch.arange(cache.length, cache.length + ids.shape[1], device=ids.device)
        hidden_p, hidden_q = self.run_flows(ids, positions, cache, 1, grouped)
        cache.commit()
        last_q = None if hidden_q is None else hidden_q[:, -1]  # (B, D)
        return self.flow_outputs(hidden_p[:, -1], last_q, grouped)

    @torch.inference_mode()
    def prefill_flows(
        self, ids: torch.Tensor, cache: KVCache | None = None
    ) -> tuple[FlowOutput, KVCache]:
        """Prefill: primary over the prompt ids (B, N) writes K/V; the aux runs at N-1 only."""
        if cache is None:
            cache = self.new_cache(ids.shape[0], self.cfg.max_seq_len)
        return self._cached_flows(ids, cache, grouped=False), cache

    @torch.inference_mode()
    def prefill(
        self, ids: torch.Tensor, cache: KVCache | None = None
    ) -> tuple[torch.Tensor, KVCache]:
        """Prefill phase: log P (B, V) at the last prompt position, and the cache."""
        out, cache = self.prefill_flows(ids, cache)
        return out.log_probs, cache

    @torch.inference_mode()
    def decode_flows(self, ids: torch.Tensor, cache: KVCache, grouped: bool = True) -> FlowOutput:
        """One decode step for ids (B,): the primary appends K/V at t, the aux attends [:t+1]."""
        return self._cached_flows(ids[:, None], cache, grouped)

    @torch.inference_mode()
    def decode_step(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Decode phase, grouped execution: log P (B, V)."""
        return self.decode_flows(ids, cache, grouped=True).log_probs

    @torch.inference_mode()
    def decode_step_separate(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Decode phase as two passes per layer (primary, then aux): same log P, weights read
        twice; the reference the grouped step is measured against."""
        return self.decode_flows(ids, cache, grouped=False).log_probs
