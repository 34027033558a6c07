"""The baseline causal LM: a Llama-style decoder with explicit prefill and decode phases.

`forward` is the teacher-forced pass used for training and as ground truth; `prefill` writes a
contiguous KV cache and returns last-position logits; `decode_step` appends one token per row.
`generate` built on them is the reference the paged engine's golden tests compare against.
How K/V are stored is delegated to an attention context, so the paged engine runs these same
layers over its block tables.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
from torch import nn

from splitphase.kernels import decode_stack, packed_linear, skinny
from splitphase.model import compiled
from splitphase.model.attention_context import AttentionContext, KVCache, NoCache
from splitphase.model.config import ModelConfig
from splitphase.model.layers import (
    Attention,
    RMSNorm,
    RopeScaling,
    SwiGLU,
    rope_cos_sin,
)
from splitphase.model.moe import MoE

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP (dense SwiGLU or MoE) with residuals."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype)
        self.mlp: nn.Module = (
            MoE(cfg, dtype) if cfg.is_moe else SwiGLU(cfg.d_model, cfg.d_ff, dtype)
        )

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        x, h2 = self._attention(x, self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(h2)

    def step(
        self,
        x: torch.Tensor,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx: AttentionContext,
        next_norm: RMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, D) and h = input_layernorm(x) -> (this layer's output, next_norm of it).

        Each residual add rides in the norm that reads it (one pass instead of two).
        """
        x, h2 = self._attention(x, h, cos, sin, ctx)
        return next_norm.residual(x, self.mlp(h2))

    def _attention(
        self, x: torch.Tensor, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        ctx: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + attention output, post_attention_layernorm of it)."""
        q, k, v = self.self_attn.project_qkv(h, cos, sin)
        o = self.self_attn.o_proj(ctx.attend(self.layer_idx, self.self_attn, q, k, v))
        return self.post_attention_layernorm.residual(x, o)


class Transformer(nn.Module):
    """Baseline decoder-only LM."""

    has_aux_flow = False  # the engine asks a model whether it runs an auxiliary decode flow

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        dtype = TORCH_DTYPES[cfg.dtype]
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype)
        self.lm_head = (
            None
            if cfg.tie_embeddings
            else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False, dtype=dtype)
        )
        self._rope_scaling = RopeScaling.of(cfg)
        # The fused decode's weight list, built once: walking 100+ submodule attributes costs
        # ~0.1 ms a step. load_state_dict and .to() keep the Parameter objects (the latter
        # through _apply, which drops the list anyway).
        self._decode_weight_list: list[torch.Tensor] | None = None
        self._head_packed = packed_linear.PackedWeight()  # the LM head past the skinny rows
        self.apply(self._init_weights)
        # GPT-2's residual scaling keeps the residual stream's variance flat with depth.
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "mlp.down")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin shaped (B or 1, T, 1, D) for positions (B, T) or (T,)."""
        cos, sin = rope_cos_sin(
            positions, self.cfg.head_dim, self.cfg.rope_theta, self.dtype, self._rope_scaling
        )
        if positions.dim() == 1:
            cos, sin = cos[None], sin[None]
        return cos[:, :, None, :], sin[:, :, None, :]

    def hidden_states(
        self, ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        """Final-normed hidden states (B, T, D) for token ids (B, T)."""
        cos, sin = self.rope(positions)
        x = self.embed_tokens(ids)  # (B, T, D)
        fused = self._fused_decode(x, cos, sin, ctx)  # one native call beats compiled pieces
        if fused is not None:
            return fused
        phase = compiled.wanted(self, ids, ctx)
        if phase is not None:
            return compiled.run_layers(self, x, cos, sin, ctx, phase)
        layers = cast(list[DecoderLayer], list(self.layers))
        if not layers:
            return self.norm(x)
        h = layers[0].input_layernorm(x)
        norms = [layer.input_layernorm for layer in layers[1:]] + [self.norm]
        for layer, next_norm in zip(layers, norms, strict=True):
            x, h = layer.step(x, h, cos, sin, ctx, next_norm)
        return h

    def _fused_decode(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor | None:
        """All layers and the final norm in one native call when ctx runs a decode pass (one
        token per row) of a dense model without QK-norm; None where the per-op path must run."""
        plan_of = getattr(ctx, "decode_plan", None)
        if plan_of is None or self.cfg.is_moe or self.cfg.qk_norm or not decode_stack.is_enabled():
            return None
        plan = plan_of()
        flat = x.reshape(-1, x.shape[-1])  # (B, D): one token per row
        c, s = cos.reshape(-1, cos.shape[-1]), sin.reshape(-1, sin.shape[-1])  # (B or 1, D)
        if plan is None or plan.write_slots.shape[0] != flat.shape[0] or c.shape[0] not in (
            1, flat.shape[0]
        ):
            return None
        weights = self._decode_weights()
        if not self.layers or not decode_stack.usable(flat, [*weights, self.norm.weight], plan):
            return None
        packed = None
        if flat.shape[0] > skinny.max_rows(flat.dtype) and packed_linear.usable(flat, weights[1]):
            # Past the skinny kernel's rows the native pass would call torch's linear, which
            # repacks each weight every call; GEMMs on packed weights won (base-125m, context
            # 256: fp32 64 rows 95.7 against 104.6 ms a step on the Intel host). oneDNN's run
            # inside the native pass (AMD host, `bench/decode_ab.py --blocks`: 0.93x the per-op
            # path's step at 5-8 rows fp32, 0.85x bf16); MKL's, and copies the packing budget
            # refused, in the per-op path.
            packed = self._decode_packed(flat.dtype)
            if packed is None:
                return None
        out = decode_stack.decode_layers(
            flat, weights, self.norm.weight, plan, c, s, self.cfg.norm_eps, self.cfg.n_heads,
            packed,
        )
        return out.view_as(x)

    def _decode_packed(self, dtype: torch.dtype) -> list[torch.Tensor] | None:
        """oneDNN's packed copies the per-op path's linears use, 5 a layer in decode_stack's
        order (Q/K/V stacked, O, gate, up, down); None where they are MKL's or refused."""
        if packed_linear.backend_for(dtype) != "onednn":
            return None
        out: list[torch.Tensor] = []
        for layer in cast(list[DecoderLayer], list(self.layers)):
            attn, mlp = layer.self_attn, cast(SwiGLU, layer.mlp)
            wanted = [(attn.qkv_packed, [attn.q_proj.weight, attn.k_proj.weight,
                                         attn.v_proj.weight])]
            wanted += [(lin.packed, [lin.weight]) for lin in
                       (attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)]
            for pack, ws in wanted:
                got = pack.get(ws, "onednn")
                if got is None:
                    return None
                out.append(got[0])
        return out

    def _apply(self, fn: Any, recurse: bool = True) -> Transformer:
        self._decode_weight_list = None  # .to(), .float(), ...: parameters may be new tensors
        self._head_packed = packed_linear.PackedWeight()
        return super()._apply(fn, recurse)

    def _decode_weights(self) -> list[torch.Tensor]:
        """Per layer, in decode_stack.cpp's order: norm, q, k, v, o, norm, gate, up, down."""
        if self._decode_weight_list is None:
            self._decode_weight_list = self._collect_decode_weights()
        return self._decode_weight_list

    def _collect_decode_weights(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for layer in cast(list[DecoderLayer], list(self.layers)):
            attn, mlp = layer.self_attn, cast(SwiGLU, layer.mlp)  # dense: checked by the caller
            out += [layer.input_layernorm.weight, attn.q_proj.weight, attn.k_proj.weight,
                    attn.v_proj.weight, attn.o_proj.weight, layer.post_attention_layernorm.weight,
                    mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
        return out

    def logits(self, hidden: torch.Tensor, pass_rows: int = 0) -> torch.Tensor:
        """Output head (tied or not): (..., D) -> (..., V). pass_rows: the tokens of the pass
        that made hidden, when it is that pass's last rows (picks the kernel's threads)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        rows = hidden.numel() // hidden.shape[-1] if hidden.shape[-1] else 0
        # A decode step wider than the skinny kernel's rows: the packed GEMM, as its layers.
        if hidden.device.type == "cpu" and rows > skinny.max_rows(hidden.dtype):
            out = packed_linear.linear(hidden, weight, self._head_packed)
            if out is not None:
                return out
        return skinny.linear(hidden, weight, pass_rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits (B, T, V) with no cache."""
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.logits(self.hidden_states(ids, positions, NoCache()))

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache(self.cfg, batch, max_len, self.dtype, self.device)

    def _cached_pass(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        cache.begin(ids.shape[1])
        positions = torch.arange(cache.length, cache.length + ids.shape[1], device=ids.device)
        hidden = self.hidden_states(ids, positions, cache)
        cache.commit()
        return self.logits(hidden[:, -1], ids.numel())  # (B, V)

    @torch.inference_mode()
    def prefill(
        self, ids: torch.Tensor, cache: KVCache | None = None
    ) -> tuple[torch.Tensor, KVCache]:
        """Prefill phase: process prompt ids (B, N), write K/V, return last logits (B, V)."""
        if cache is None:
            cache = self.new_cache(ids.shape[0], self.cfg.max_seq_len)
        return self._cached_pass(ids, cache), cache

    @torch.inference_mode()
    def decode_step(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Decode phase: one new token per row, ids (B,), returns logits (B, V)."""
        return self._cached_pass(ids[:, None], cache)

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int = 0,
        seed: int | None = None,
        eos_token_id: int | None = None,
    ) -> list[int]:
        """Reference generation for one prompt: prefill, then one decode step per token."""
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        max_len = min(self.cfg.max_seq_len, len(prompt_ids) + max_new_tokens)
        logits, cache = self.prefill(ids, self.new_cache(1, max_len))
        gen = torch.Generator(device="cpu")
        gen.manual_seed(0 if seed is None else seed)
        out: list[int] = []
        for _ in range(max_new_tokens):
            token = sample_token(logits[0], temperature, top_k, gen)
            out.append(token)
            if token == eos_token_id or cache.length >= max_len:
                break
            logits = self.decode_step(torch.tensor([token], device=self.device), cache)
        return out


def sample_token(logits: torch.Tensor, temperature: float, top_k: int, gen: torch.Generator) -> int:
    """Greedy when temperature is 0, else temperature / top-k sampling from logits (V,)."""
    if temperature <= 0:
        return int(logits.argmax())
    scaled = logits.float().cpu() / temperature
    if top_k > 0:
        kth = scaled.topk(min(top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    return draw(torch.softmax(scaled, -1), gen)


def draw(probs: torch.Tensor, gen: torch.Generator) -> int:
    """One index of probs (V,) (non-negative weights, any positive sum) drawn with that
    probability: the inverse CDF at one uniform from gen. torch.multinomial's one-sample path
    draws V exponentials instead (Gumbel-max): 566 us a row at V = 32000 on the 2-core machine
    against 28 us here (a sampled 16-row decode step spent 9 ms in it). An index of zero
    weight is never drawn; weights with no positive finite sum raise, as torch.multinomial
    does."""
    cdf = probs.cumsum(0, dtype=torch.float64)
    total = float(cdf[-1])
    if not (total > 0 and math.isfinite(total)):
        raise ValueError(f"cannot sample from weights summing to {total}")
    u = torch.rand(1, dtype=torch.float64, generator=gen) * total
    index = int(torch.searchsorted(cdf, u, right=True))
    # u < total, but u * total can round up to it (p ~ 2^-53): take the last positive weight.
    return index if index < probs.numel() else int(probs.nonzero().max())
