"""A step's FLOPs and bytes for the cost model: `audit.flops` in general, a closed form for dense.

`step_work` asks `audit.flops.step_cost` and `attention_cost` (any model). For a dense model
(no MoE, no Dual-Flow) every one of those formulas is an integer-valued linear function of five
row counts, so `DenseStepWork` multiplies the counts by per-model coefficients computed once.
Python integers are exact, so its figures equal the general path's bit for bit
(tests/sim/test_step_work.py checks it), at a tenth of the cost: the simulator prices millions
of steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from splitphase.audit.flops import (
    attention_cost,
    attn_matmul_params,
    kv_bytes_per_token,
    mlp_params,
    norm_params_per_layer,
    step_cost,
)
from splitphase.model.config import ModelConfig


class StepWork(NamedTuple):
    """One step's FLOPs and HBM bytes: whole step, its prefill and decode parts, its attention.

    A NamedTuple rather than a frozen dataclass: one is built per simulated step, and a tuple
    is built in a third of the time.
    """

    flops: float
    bytes: float
    prefill_flops: float
    prefill_bytes: float
    decode_flops: float
    decode_bytes: float
    attn_flops: float  # QK^T and AV over the KV cache (part of `flops`)
    attn_bytes: float  # KV read and written (part of `bytes`)
    num_tokens: int  # prompt tokens plus decode tokens fed
    num_seqs: int


def step_work(cfg: ModelConfig, chunks: Sequence[tuple[int, int]],
              decode_context_lens: Sequence[int], dtype_bytes: float,
              kv_dtype_bytes: int | None = None) -> StepWork:
    """The general path: chunks are (new, before), decodes their cached lengths."""
    kv = kv_dtype_bytes
    cost = step_cost(cfg, chunks, decode_context_lens, dtype_bytes, kv_dtype_bytes=kv)
    attn = attention_cost(cfg, chunks, decode_context_lens, dtype_bytes, kv_dtype_bytes=kv)
    return StepWork(cost.flops, cost.bytes, cost.prefill.flops, cost.prefill.bytes,
                    cost.decode.flops, cost.decode.bytes, attn.flops, attn.bytes,
                    cost.num_prefill_tokens + cost.num_decode_tokens,
                    len(chunks) + len(decode_context_lens))


class DenseStepWork:
    """`step_work` of a dense model from row counts (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, dtype_bytes: float, kv_dtype_bytes: int | None = None
                 ) -> None:
        if cfg.is_moe or cfg.is_dual_flow:
            raise ValueError(f"{cfg.name}: the closed form covers dense single-flow models only")
        pq, pkv, po = attn_matmul_params(cfg)
        layers, d_model, head_rows = cfg.n_layers, cfg.d_model, cfg.vocab_size * cfg.d_model
        mlp = int(mlp_params(cfg, 0))  # an int for a dense model, whatever `routed` is
        # The same terms as audit.flops._flops, _weight_bytes and _bytes (with no aux flow).
        self.row_flops = 2 * layers * (pq + pkv + po + mlp)
        self.pair_flops = layers * 4 * cfg.q_dim
        self.logit_flops = 2 * head_rows
        params = layers * (pq + pkv + po + norm_params_per_layer(cfg) + mlp) + head_rows + d_model
        self.dtype_bytes, self.params, self.d_model = dtype_bytes, params, d_model
        kv_b = max(1, int(dtype_bytes)) if kv_dtype_bytes is None else kv_dtype_bytes
        self.kv_bytes = kv_bytes_per_token(cfg, kv_b)  # None: as wide as the weights (_kv_bytes)

    def _flops(self, rows: int, pairs: int, logits: int) -> float:
        return float(self.row_flops * rows + self.pair_flops * pairs + self.logit_flops * logits)

    def _bytes(self, rows: int, kv_read: int) -> float:
        if rows == 0:
            return 0.0  # nothing scheduled: no weights are read
        weights = self.dtype_bytes * (self.params + rows * self.d_model)
        return weights + self.kv_bytes * (kv_read + rows)

    def work(self, chunks: Sequence[tuple[int, int]], num_decodes: int, num_cached: int
             ) -> StepWork:
        """Chunks (new, before) plus `num_decodes` decodes over `num_cached` cached tokens."""
        p_rows = p_pairs = p_kv = 0
        for new, before in chunks:  # audit.flops._attn_pairs, causal, every new token a query
            p_rows += new
            p_pairs += new * before + new * (new + 1) // 2
            p_kv += before
        p_logits = len(chunks)  # one logit row per chunk (logits_per_chunk = 1)
        d_pairs = num_cached + num_decodes  # each decode attends its cache plus itself
        rows, pairs, kv_read = p_rows + num_decodes, p_pairs + d_pairs, p_kv + num_cached
        attn_bytes = self.kv_bytes * (kv_read + rows) if rows else 0
        return StepWork(
            self._flops(rows, pairs, p_logits + num_decodes),
            self._bytes(rows, kv_read),
            self._flops(p_rows, p_pairs, p_logits),
            self._bytes(p_rows, p_kv),
            self._flops(num_decodes, d_pairs, num_decodes),
            self._bytes(num_decodes, num_cached),
            float(self.pair_flops * pairs),
            float(attn_bytes),
            rows,
            len(chunks) + num_decodes,
        )
