"""Where a forward pass keeps K/V: the attention-context protocols and the reference caches.

`NoCache` is plain causal attention (training, teacher forcing); `KVCache` is the contiguous
cache of the reference `generate`, which the paged engine's golden tests compare against. The
engine's paged pool implements the same protocols over block tables.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from splitphase.kernels import skinny
from splitphase.kernels.attention import decode_attention
from splitphase.kernels.decode_stack import DecodePlan
from splitphase.model.config import ModelConfig
from splitphase.model.layers import Attention, causal_mask


class AttentionContext(Protocol):
    """Where one forward pass reads and writes K/V."""

    def attend(
        self, layer_idx: int, attn: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Store k, v (B, T, G, D) as needed and return attention output (B, T, H*D)."""
        ...


class AuxAttentionContext(AttentionContext, Protocol):
    """A context that also serves the Dual-Flow auxiliary query, read-only (nothing is stored)."""

    def attend_cached(self, layer_idx: int, attn: Attention, q: torch.Tensor) -> torch.Tensor:
        """q (B, Tq, H, D) for the last Tq positions of this pass attends to the K/V already
        stored for the same rows up to and including each position; returns (B, Tq, H*D).
        Call it after `attend` for the same layer in the same pass."""
        ...


@runtime_checkable
class AuxSelfKVContext(AuxAttentionContext, Protocol):
    """Also serves the `aux_self_kv` variant: the aux query sees one uncached key of its own."""

    def attend_cached_self_kv(
        self,
        layer_idx: int,
        attn: Attention,
        q: torch.Tensor,
        k_self: torch.Tensor,
        v_self: torch.Tensor,
    ) -> torch.Tensor:
        """As `attend_cached`, plus query i attends k_self/v_self (B, Tq, G, D) at row i."""
        ...


def attend_prefix(
    attn: Attention,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    self_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention of q (B, Tq, H, D), the last Tq of the S positions of k/v (B, S, G, D),
    plus each query's own extra key/value from self_kv; returns (B, Tq, H*D)."""
    if self_kv is None:
        return attn.attend_causal(q, k, v)
    q_len, kv_len = q.shape[1], k.shape[1]
    mask = None if q_len == 1 else causal_mask(q_len, kv_len, q.device)  # (Tq, S)
    k, v = torch.cat([k, self_kv[0]], 1), torch.cat([v, self_kv[1]], 1)  # (B, S+Tq, G, D)
    if mask is not None:  # query i sees its own extra key i only
        own = torch.eye(q_len, dtype=torch.bool, device=q.device)  # (Tq, Tq)
        mask = torch.cat([mask, own], -1)  # (Tq, S+Tq)
    return attn.attend(q, k, v, mask=mask, causal=False)


class NoCache:
    """Plain causal self-attention over the given tokens (training, teacher forcing)."""

    def attend(
        self, layer_idx: int, attn: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        return attn.attend_causal(q, k, v)


class KVCache:
    """Contiguous per-layer K/V of shape (L, B, T_max, G, D); every row has the same length."""

    def __init__(
        self, cfg: ModelConfig, batch: int, max_len: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        shape = (cfg.n_layers, batch, max_len, cfg.n_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0  # tokens whose K/V are stored
        self._pending = 0  # tokens written by the pass in flight
        self._decode_slots: tuple[int, torch.Tensor, torch.Tensor] | None = None  # per step

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def begin(self, num_tokens: int) -> None:
        """Reserve room for a pass over num_tokens new tokens."""
        if self.length + num_tokens > self.max_len:
            raise ValueError(
                f"KV cache holds {self.max_len} tokens; {self.length} used, {num_tokens} more asked"
            )
        self._pending = num_tokens

    def commit(self) -> None:
        self.length += self._pending
        self._pending = 0

    def attend(
        self, layer_idx: int, attn: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        start, end = self.length, self.length + k.shape[1]
        self.k[layer_idx, :, start:end] = k
        self.v[layer_idx, :, start:end] = v
        k_all, v_all = self.k[layer_idx, :, :end], self.v[layer_idx, :, :end]  # (B, S, G, D)
        q_len = q.shape[1]
        if q_len == 1:  # one new token attends to everything before it: no mask needed
            return self._decode_attend(layer_idx, attn, q, end)
        return attn.attend_causal(q, k_all, v_all)  # causal from position `start`

    def _decode_attend(
        self, layer_idx: int, attn: Attention, q: torch.Tensor, end: int
    ) -> torch.Tensor:
        """One token per row over positions [0, end): the native kernel reads the cache in place."""
        if not skinny.is_enabled() or q.device.type != "cpu":
            k_all, v_all = self.k[layer_idx, :, :end], self.v[layer_idx, :, :end]
            return attn.attend(q, k_all, v_all, mask=None, causal=False)
        pool_k = self.k[layer_idx].flatten(0, 1)  # (B*T_max, G, D), row b at b*T_max
        pool_v = self.v[layer_idx].flatten(0, 1)
        slots, lengths = self._step_slots(end)
        out = decode_attention(q[:, 0], pool_k, pool_v, slots, lengths)  # (B, H, D)
        return out.flatten(1)[:, None]  # (B, 1, H*D)

    def _step_slots(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Pool slots (B, S) of positions [0, end) of every row, and lengths (B,): once a step."""
        if self._decode_slots is None or self._decode_slots[0] != end:
            batch, max_len = self.k.shape[1], self.k.shape[2]
            slots = torch.arange(end)[None] + torch.arange(batch)[:, None] * max_len  # (B, S)
            self._decode_slots = (end, slots, torch.full((batch,), end, dtype=torch.long))
        return self._decode_slots[1], self._decode_slots[2]

    def decode_plan(self) -> DecodePlan | None:
        """The pass in flight as pool slots when it feeds one token per row (else None)."""
        if self._pending != 1 or self.k.device.type != "cpu":
            return None
        batch, max_len = self.k.shape[1], self.k.shape[2]
        slots, lengths = self._step_slots(self.length + 1)
        write = torch.arange(batch) * max_len + self.length  # (B,) row b's slot b*T_max + t
        # (L, B*T_max, G, D) views: row b's positions are one pool's slots from b*T_max
        return DecodePlan(self.k.flatten(1, 2), self.v.flatten(1, 2), write, slots, lengths)

    def attend_cached(self, layer_idx: int, attn: Attention, q: torch.Tensor) -> torch.Tensor:
        """Read-only attention over the stored K/V, including this pass's (see the protocol)."""
        return attend_prefix(attn, q, *self._stored(layer_idx))

    def attend_cached_self_kv(
        self,
        layer_idx: int,
        attn: Attention,
        q: torch.Tensor,
        k_self: torch.Tensor,
        v_self: torch.Tensor,
    ) -> torch.Tensor:
        """`attend_cached` plus each query's own uncached key/value."""
        return attend_prefix(attn, q, *self._stored(layer_idx), (k_self, v_self))

    def _stored(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + self._pending  # the pass in flight has written its K/V already
        return self.k[layer_idx, :, :end], self.v[layer_idx, :, :end]  # (B, S, G, D) each
