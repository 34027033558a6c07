"""Closed-form FLOP and byte counts per phase, from a `ModelConfig` alone (no torch, SI units).

Conventions (shared/design/dual_flow.md, section 4):
- FLOPs are matmul FLOPs only, 2 per multiply-add: the Q/K/V/O and MLP projections, the MoE
  router, the LM head, and attention's QK^T and AV (2*H*d each per query-key pair). Norms,
  RoPE, softmax, SiLU, the Dual-Flow coupling products and embedding lookups are not counted,
  which is also what torch's FlopCounterMode counts.
- Bytes are HBM traffic under ideal reuse: every weight read once per step, one embedding row per
  token, KV read for the cached context and written for every new token. Activations are assumed
  to stay on chip; that underestimates bytes for long prefills, where they do not matter (prefill
  is compute-bound anyway).
- A token at position p attends to p + 1 keys (itself included). A decode step for a sequence
  with `T` cached tokens is therefore a chunk of 1 new token after `T` computed ones: it reads T
  KV entries, writes 1, and attends over T + 1 (the design doc writes 4LHdT, dropping the +1).
- MoE shared experts have width `d_expert` each (ModelConfig has no separate shared width), and
  every layer is an MoE layer when `n_experts > 0`.
- Dual-Flow: the aux flow runs wherever logits are produced (the last prompt position in
  prefill, every generated token, every position in training), shares all matrices and norms
  with the primary, skips the K/V projections, writes no KV, and is executed grouped with the
  primary, so its only extra bytes are its embedding rows and the coupling vectors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

from splitphase.model.config import ModelConfig


class CostError(ValueError):
    """Arguments a FLOP/byte formula cannot use; the message says what is allowed."""


@dataclass(frozen=True)
class PhaseCost:
    """FLOPs and HBM bytes of some work; `.intensity` is FLOP per byte."""

    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        if self.flops == 0 and self.bytes == 0:
            return 0.0  # idle: no work, no traffic
        return arithmetic_intensity(self.flops, self.bytes)


@dataclass(frozen=True)
class StepCost:
    """One scheduler step: prefill part alone, decode part alone, and the mixed step as run."""

    prefill: PhaseCost
    decode: PhaseCost
    total: PhaseCost  # weights read once for both parts, so bytes < prefill.bytes + decode.bytes
    num_prefill_tokens: int
    num_decode_tokens: int

    @property
    def phase(self) -> str:
        """`prefill`, `decode`, `mixed` or `idle`."""
        if self.num_prefill_tokens and self.num_decode_tokens:
            return "mixed"
        if self.num_prefill_tokens:
            return "prefill"
        return "decode" if self.num_decode_tokens else "idle"

    @property
    def flops(self) -> float:
        return self.total.flops

    @property
    def bytes(self) -> float:
        return self.total.bytes

    @property
    def intensity(self) -> float:
        return self.total.intensity


@dataclass(frozen=True)
class _Work:
    """Row counts that every formula below is linear in (so steps add field by field)."""

    pri_rows: int = 0  # tokens through the primary's projections (= KV entries written)
    pri_pairs: int = 0  # primary attention query-key pairs
    pri_logits: int = 0  # primary rows through the LM head
    aux_rows: int = 0  # aux-flow tokens (each also goes through the LM head)
    aux_pairs: int = 0  # aux attention query-key pairs (over the primary's keys)
    kv_read: int = 0  # cached KV entries read (per layer, per KV head)

    def __add__(self, other: _Work) -> _Work:
        return _Work(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


# ---------------------------------------------------------------- parameter counts


def attn_matmul_params(cfg: ModelConfig) -> tuple[int, int, int]:
    """(Pq, Pkv, Po) per layer: the query, key+value and output projections."""
    return cfg.d_model * cfg.q_dim, 2 * cfg.d_model * cfg.kv_dim, cfg.q_dim * cfg.d_model


def mlp_params(cfg: ModelConfig, routed: float) -> float:
    """MLP parameters per layer with `routed` experts (SwiGLU: 3 matrices; MoE adds a router)."""
    if not cfg.is_moe:
        return 3 * cfg.d_model * cfg.d_ff
    per_expert = 3 * cfg.d_model * cfg.d_expert
    return per_expert * (routed + cfg.n_shared_experts) + cfg.d_model * cfg.n_experts


def dense_linear_shapes(cfg: ModelConfig) -> list[tuple[int, int, int]]:
    """(out, in, count) of a dense decoder layer's linears: q, k+v, o, gate+up, down."""
    if cfg.is_moe:
        raise CostError("dense_linear_shapes is for dense models; an MoE layer routes per token")
    d = cfg.d_model
    return [(cfg.q_dim, d, 1), (cfg.kv_dim, d, 2), (d, cfg.q_dim, 1), (cfg.d_ff, d, 2),
            (d, cfg.d_ff, 1)]


def norm_params_per_layer(cfg: ModelConfig) -> int:
    """RMSNorm weights per layer: two of d_model, plus the q/k norms' head_dim each if used."""
    return 2 * cfg.d_model + (2 * cfg.head_dim if cfg.qk_norm else 0)


def coupling_param_count(cfg: ModelConfig) -> int:
    """Dual-Flow coupling vectors a[H*d], b[F], c[D] per layer, as the coupling mode uses them.

    For MoE, b couples the shared experts' intermediate (S * d_expert wide; absent without
    shared experts): routed intermediates differ per chosen expert and cannot be matched.
    """
    if not cfg.is_dual_flow or cfg.coupling == "none":
        return 0
    per_layer = cfg.q_dim + cfg.d_model  # a and c
    if cfg.coupling == "abc":
        per_layer += cfg.n_shared_experts * cfg.d_expert if cfg.is_moe else cfg.d_ff
    return cfg.n_layers * per_layer


def _non_layer_params(cfg: ModelConfig) -> int:
    """Embedding(s), LM head when untied, final norm, Dual-Flow aux embedding and couplings."""
    table = cfg.vocab_size * cfg.d_model
    total = table + (0 if cfg.tie_embeddings else table) + cfg.d_model
    if cfg.is_dual_flow:
        total += table + coupling_param_count(cfg)
    return total


def param_count(cfg: ModelConfig) -> int:
    """All parameters: embeddings, every expert, router, shared experts, norms, Dual-Flow extras."""
    pq, pkv, po = attn_matmul_params(cfg)
    per_layer = pq + pkv + po + norm_params_per_layer(cfg) + mlp_params(cfg, cfg.n_experts)
    return int(cfg.n_layers * per_layer) + _non_layer_params(cfg)


def active_param_count(cfg: ModelConfig) -> int:
    """Parameters one primary token uses: all but the routed experts it does not select."""
    unselected = cfg.n_experts - cfg.top_k  # 0 for dense configs
    return param_count(cfg) - cfg.n_layers * unselected * 3 * cfg.d_model * cfg.d_expert


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int = 2) -> int:
    """KV-cache bytes per token: 2 (K and V) * L * G * d * b; Dual-Flow adds none."""
    return 2 * cfg.n_layers * cfg.kv_dim * dtype_bytes


# ---------------------------------------------------------------- work -> FLOPs, bytes


def _attn_pairs(queries: int, new: int, before: int, causal: bool) -> int:
    """Query-key pairs for the last `queries` of `new` tokens placed after `before` cached ones."""
    if not causal:
        return queries * (before + new)  # full score matrix, as SDPA FLOP counters report it
    # Query j (1-based within the chunk) sees before + j keys; sum over j = new-queries+1 .. new.
    return queries * before + queries * (2 * new - queries + 1) // 2


def _chunk_work(cfg: ModelConfig, new: int, before: int, logits: int, causal: bool) -> _Work:
    if new <= 0 or before < 0:
        raise CostError(f"a prefill chunk needs new > 0, before >= 0, got {new}, {before}")
    if not 0 <= logits <= new:
        raise CostError(f"logits_positions must be in [0, {new}] (the new tokens), got {logits}")
    aux_rows = logits if cfg.is_dual_flow else 0
    aux_pairs = _attn_pairs(aux_rows, new, before, causal)
    if cfg.aux_self_kv:
        aux_pairs += aux_rows  # the aux query also scores its own key
    return _Work(
        pri_rows=new,
        pri_pairs=_attn_pairs(new, new, before, causal),
        pri_logits=logits,
        aux_rows=aux_rows,
        aux_pairs=aux_pairs,
        kv_read=before,
    )


def _decode_work(cfg: ModelConfig, context_lens: Sequence[int]) -> _Work:
    if any(t < 0 for t in context_lens):
        raise CostError(f"context lengths must be >= 0, got {list(context_lens)}")
    batch, cached = len(context_lens), sum(context_lens)
    pairs = cached + batch  # each new token attends over its T cached keys plus itself
    aux_rows = batch if cfg.is_dual_flow else 0
    aux_pairs = pairs if cfg.is_dual_flow else 0
    if cfg.aux_self_kv:
        aux_pairs += aux_rows
    return _Work(batch, pairs, batch, aux_rows, aux_pairs, cached)


def _flops(cfg: ModelConfig, work: _Work) -> float:
    pq, pkv, po = attn_matmul_params(cfg)
    layers, attn_per_pair = cfg.n_layers, 4 * cfg.q_dim  # QK^T and AV: 2*H*d each
    head = 2 * cfg.d_model * cfg.vocab_size
    pri = 2 * layers * (pq + pkv + po + mlp_params(cfg, cfg.top_k)) * work.pri_rows
    pri += layers * attn_per_pair * work.pri_pairs + head * work.pri_logits
    if not work.aux_rows:
        return float(pri)
    # The aux flow skips the K/V projections unless it attends its own K/V (aux_self_kv).
    aux_block = pq + po + mlp_params(cfg, cfg.aux_k) + (pkv if cfg.aux_self_kv else 0)
    aux = 2 * layers * aux_block * work.aux_rows
    aux += layers * attn_per_pair * work.aux_pairs + head * work.aux_rows
    return float(pri + aux)


def expected_distinct_experts(cfg: ModelConfig, primary_tokens: int, aux_tokens: int = 0) -> float:
    """Expected experts touched per layer under uniform routing, capped at n_experts.

    Each primary token picks top_k distinct experts and each aux token aux_k, independently, so an
    expert is missed with probability (1-k1/E)^n1 * (1-k2/E)^n2 and the expected union is
    E * (1 - that). Replay routing reuses the primary's picks, so aux tokens add nothing.
    """
    if not cfg.is_moe or primary_tokens <= 0:
        return 0.0
    experts = cfg.n_experts
    miss = (1 - cfg.top_k / experts) ** primary_tokens
    if cfg.is_dual_flow and cfg.aux_routing == "independent" and aux_tokens > 0:
        miss *= (1 - cfg.aux_k / experts) ** aux_tokens
    return min(float(experts), experts * (1 - miss))


def _weight_bytes(cfg: ModelConfig, work: _Work, dtype_bytes: float) -> float:
    pq, pkv, po = attn_matmul_params(cfg)
    distinct = expected_distinct_experts(cfg, work.pri_rows, work.aux_rows)
    per_layer = pq + pkv + po + norm_params_per_layer(cfg) + mlp_params(cfg, distinct)
    head = cfg.vocab_size * cfg.d_model  # the LM head is read in full (tied or not)
    params = cfg.n_layers * per_layer + head + cfg.d_model + coupling_param_count(cfg)
    rows = work.pri_rows + work.aux_rows  # one embedding row per token and flow
    return dtype_bytes * (params + rows * cfg.d_model)


def _bytes(cfg: ModelConfig, work: _Work, dtype_bytes: float, kv_dtype_bytes: int | None) -> float:
    if work.pri_rows == 0:
        return 0.0  # nothing scheduled: no weights are read
    return _weight_bytes(cfg, work, dtype_bytes) + _kv_bytes(cfg, work, dtype_bytes, kv_dtype_bytes)


def _kv_bytes(cfg: ModelConfig, work: _Work, dtype_bytes: float, kv_dtype_bytes: int | None) -> int:
    """K/V read and written; kv_dtype_bytes None: as wide as the weights (quantized: give it)."""
    kv_b = max(1, int(dtype_bytes)) if kv_dtype_bytes is None else kv_dtype_bytes
    return kv_bytes_per_token(cfg, kv_b) * (work.kv_read + work.pri_rows)


def _check_bytes(dtype_bytes: float, kv_dtype_bytes: int | None) -> None:
    if dtype_bytes <= 0 or (kv_dtype_bytes is not None and kv_dtype_bytes <= 0):
        raise CostError(f"bytes per element must be > 0, got {dtype_bytes}, {kv_dtype_bytes}")


# ---------------------------------------------------------------- public per-phase formulas


def arithmetic_intensity(flops: float, bytes: float) -> float:
    """FLOP per byte moved; bytes must be > 0."""
    if bytes <= 0:
        raise CostError(f"arithmetic intensity needs bytes > 0, got {bytes}")
    return flops / bytes


def prefill_flops(
    cfg: ModelConfig,
    prompt_len: int,
    *,
    num_computed: int = 0,
    logits_positions: int = 1,
    causal_attention: bool = True,
) -> float:
    """Matmul FLOPs to prefill `prompt_len` new tokens after `num_computed` cached ones.

    The LM head (and the Dual-Flow aux flow) runs at the last `logits_positions` positions: 1 as
    the engine samples, `prompt_len` for a training-style forward. `causal_attention=False`
    counts the full N x N score matrix as FlopCounterMode does for SDPA.
    """
    work = _chunk_work(cfg, prompt_len, num_computed, logits_positions, causal_attention)
    return _flops(cfg, work)


def prefill_bytes(
    cfg: ModelConfig,
    prompt_len: int,
    *,
    num_computed: int = 0,
    logits_positions: int = 1,
    dtype_bytes: float = 2,
    kv_dtype_bytes: int | None = None,
) -> float:
    """HBM bytes of a prefill: weights once, embedding rows, cached KV read, new KV written."""
    _check_bytes(dtype_bytes, kv_dtype_bytes)
    work = _chunk_work(cfg, prompt_len, num_computed, logits_positions, True)
    return _bytes(cfg, work, dtype_bytes, kv_dtype_bytes)


def decode_flops(cfg: ModelConfig, context_lens: Sequence[int]) -> float:
    """Matmul FLOPs of one decode step: one new token per sequence with T cached tokens each."""
    return _flops(cfg, _decode_work(cfg, context_lens))


def decode_bytes(
    cfg: ModelConfig,
    context_lens: Sequence[int],
    dtype_bytes: float = 2,
    kv_dtype_bytes: int | None = None,
) -> float:
    """HBM bytes of one decode step: weights (distinct experts for MoE) once, KV read and write."""
    _check_bytes(dtype_bytes, kv_dtype_bytes)
    return _bytes(cfg, _decode_work(cfg, context_lens), dtype_bytes, kv_dtype_bytes)


def prefill_cost(
    cfg: ModelConfig, prompt_len: int, dtype_bytes: float = 2, *, kv_dtype_bytes: int | None = None
) -> PhaseCost:
    """FLOPs and bytes of prefilling one prompt from scratch (logits at the last position)."""
    nbytes = prefill_bytes(cfg, prompt_len, dtype_bytes=dtype_bytes, kv_dtype_bytes=kv_dtype_bytes)
    return PhaseCost(prefill_flops(cfg, prompt_len), nbytes)


def decode_cost(
    cfg: ModelConfig, context_lens: Sequence[int], dtype_bytes: float = 2, *,
    kv_dtype_bytes: int | None = None,
) -> PhaseCost:
    """FLOPs and bytes of one decode step of a batch."""
    nbytes = decode_bytes(cfg, context_lens, dtype_bytes, kv_dtype_bytes)
    return PhaseCost(decode_flops(cfg, context_lens), nbytes)


def training_flops(cfg: ModelConfig, seq_len: int, *, causal_attention: bool = True) -> float:
    """Forward + backward matmul FLOPs for one sequence: 3x a forward with logits everywhere."""
    return 3 * prefill_flops(cfg, seq_len, logits_positions=seq_len,
                             causal_attention=causal_attention)


def step_cost(
    cfg: ModelConfig,
    prefill_chunks: Sequence[tuple[int, int]],
    decode_context_lens: Sequence[int],
    dtype_bytes: float = 2,
    *,
    kv_dtype_bytes: int | None = None,
    logits_per_chunk: int = 1,
) -> StepCost:
    """Cost of one scheduler step: prefill chunks `(num_new_tokens, num_computed_before)` plus
    decode sequences given by their cached lengths; O(number of sequences), no per-token loops.

    Every chunk is charged logits (and the Dual-Flow aux flow) at its last `logits_per_chunk`
    positions, as an engine that computes and discards logits for non-final chunks does.
    """
    _check_bytes(dtype_bytes, kv_dtype_bytes)
    pre = _Work()
    for new, before in prefill_chunks:
        pre = pre + _chunk_work(cfg, new, before, min(logits_per_chunk, new), True)
    dec = _decode_work(cfg, decode_context_lens)

    def cost(work: _Work) -> PhaseCost:
        return PhaseCost(_flops(cfg, work), _bytes(cfg, work, dtype_bytes, kv_dtype_bytes))

    return StepCost(
        prefill=cost(pre),
        decode=cost(dec),
        total=cost(pre + dec),
        num_prefill_tokens=pre.pri_rows,
        num_decode_tokens=dec.pri_rows,
    )


def attention_cost(
    cfg: ModelConfig,
    prefill_chunks: Sequence[tuple[int, int]],
    decode_context_lens: Sequence[int],
    dtype_bytes: float = 2,
    *,
    kv_dtype_bytes: int | None = None,
) -> PhaseCost:
    """The attention part of `step_cost`: QK^T and AV FLOPs and the KV cache bytes (read and
    written). The rest of the step (projections, MLP, LM head, weights) runs as separate kernels,
    so a simulator can roofline the two parts one after the other.
    """
    _check_bytes(dtype_bytes, kv_dtype_bytes)
    work = _decode_work(cfg, decode_context_lens)
    for new, before in prefill_chunks:
        work = work + _chunk_work(cfg, new, before, min(1, new), True)
    flops = cfg.n_layers * 4 * cfg.q_dim * (work.pri_pairs + work.aux_pairs)
    kv = _kv_bytes(cfg, work, dtype_bytes, kv_dtype_bytes) if work.pri_rows else 0
    return PhaseCost(float(flops), float(kv))
