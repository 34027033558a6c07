"""Closed-form FLOP/byte counts: published parameter counts, design-doc formulas, invariants."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitphase.audit import flops as fl
from splitphase.model.config import ModelConfig

LLAMA8B = ModelConfig.from_name("llama-3.1-8b")
QWEN_MOE = ModelConfig.from_name("qwen3-30b-a3b")
TINY = ModelConfig.from_name("tiny")
TINY_MOE = ModelConfig.from_name("tiny-moe")


def _pblk(cfg: ModelConfig) -> int:
    """Design doc Pblk = Pq + Pkv + Po + Pm for a dense config."""
    d, hd, gd = cfg.d_model, cfg.q_dim, cfg.kv_dim
    return d * hd + 2 * d * gd + hd * d + 3 * d * cfg.d_ff


def _paux(cfg: ModelConfig) -> int:
    """Design doc Paux = Pq + Po + Pm (the aux flow skips K/V)."""
    return _pblk(cfg) - 2 * cfg.d_model * cfg.kv_dim


# ------------------------------------------------------------------ parameter counts


def test_llama_8b_param_count_is_exact() -> None:
    assert fl.param_count(LLAMA8B) == 8_030_261_248
    assert fl.active_param_count(LLAMA8B) == fl.param_count(LLAMA8B)  # dense: all active


def test_llama_8b_kv_bytes_per_token() -> None:
    assert fl.kv_bytes_per_token(LLAMA8B, 2) == 131_072
    assert fl.kv_bytes_per_token(LLAMA8B, 1) == 65_536


def test_qwen3_moe_total_and_active() -> None:
    assert fl.param_count(QWEN_MOE) == pytest.approx(30.5e9, rel=0.01)
    assert fl.active_param_count(QWEN_MOE) == pytest.approx(3.3e9, rel=0.05)


def test_mixtral_param_count() -> None:
    cfg = ModelConfig.from_name("mixtral-8x7b")
    assert fl.param_count(cfg) == pytest.approx(46.7e9, rel=0.005)
    assert fl.active_param_count(cfg) == pytest.approx(12.9e9, rel=0.01)


def test_tiny_param_count_by_hand() -> None:
    # per layer: q 64*64 + kv 2*64*32 + o 64*64 + mlp 3*64*172 + 2 norms of 64 = 45,440
    assert fl.param_count(TINY) == 2 * 45_440 + 512 * 64 + 64


def test_untied_head_qk_norm_and_moe_extras() -> None:
    base = fl.param_count(TINY)
    table = TINY.vocab_size * TINY.d_model
    assert fl.param_count(TINY.with_(tie_embeddings=False)) == base + table
    assert fl.param_count(TINY.with_(qk_norm=True)) == base + TINY.n_layers * 2 * TINY.head_dim
    # tiny-moe swaps the 3*D*F MLP for 4 experts + 1 shared (3*D*64 each) + a D*E router.
    moe_delta = TINY.n_layers * (5 * 3 * 64 * 64 + 64 * 4 - 3 * 64 * 172)
    assert fl.param_count(TINY_MOE) == base + moe_delta
    assert fl.param_count(TINY_MOE) - fl.active_param_count(TINY_MOE) == 2 * 2 * 3 * 64 * 64


def test_dual_flow_params_add_aux_embedding_and_couplings() -> None:
    cfg = LLAMA8B
    coupling = cfg.n_layers * (cfg.q_dim + cfg.d_ff + cfg.d_model)
    extra = cfg.vocab_size * cfg.d_model + coupling
    assert fl.param_count(cfg.with_(arch="dual_flow")) == fl.param_count(cfg) + extra
    assert fl.coupling_param_count(cfg.with_(arch="dual_flow", coupling="none")) == 0
    ac = cfg.n_layers * (cfg.q_dim + cfg.d_model)
    assert fl.coupling_param_count(cfg.with_(arch="dual_flow", coupling="ac")) == ac
    assert fl.coupling_param_count(cfg) == 0  # baseline has no couplings


# ------------------------------------------------------------------ FLOPs


@pytest.mark.parametrize("n", [1, 7, 2048])
def test_prefill_flops_match_design_doc(n: int) -> None:
    c = LLAMA8B
    linear = 2 * n * c.n_layers * _pblk(c)
    head = 2 * c.d_model * c.vocab_size
    causal = linear + 2 * c.n_layers * c.q_dim * n * (n + 1) + head
    assert fl.prefill_flops(c, n) == causal
    full = linear + 4 * c.n_layers * c.q_dim * n * n + n * head
    assert fl.prefill_flops(c, n, logits_positions=n, causal_attention=False) == full


def test_decode_is_a_one_token_chunk() -> None:
    for t in (0, 1, 1000):
        assert fl.decode_flops(TINY_MOE, [t]) == fl.prefill_flops(TINY_MOE, 1, num_computed=t)
    per_seq = fl.decode_flops(LLAMA8B, [5]) + fl.decode_flops(LLAMA8B, [300])
    assert fl.decode_flops(LLAMA8B, [5, 300]) == per_seq
    assert fl.decode_flops(LLAMA8B, []) == 0


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 500), st.integers(1, 500), st.booleans())
def test_chunked_prefill_adds_up(first: int, second: int, dual: bool) -> None:
    cfg = TINY_MOE.with_(arch="dual_flow") if dual else TINY_MOE
    whole = fl.prefill_flops(cfg, first + second)
    parts = fl.prefill_flops(cfg, first, logits_positions=0) + fl.prefill_flops(
        cfg, second, num_computed=first
    )
    assert parts == whole


def test_training_flops_match_design_doc_for_dual_flow() -> None:
    c = TINY.with_(arch="dual_flow")
    t = 128
    per_seq = (
        2 * t * c.n_layers * (_pblk(c) + _paux(c))
        + 4 * c.n_layers * c.q_dim * t * (t + 1)
        + 4 * t * c.d_model * c.vocab_size
    )
    assert fl.training_flops(c, t) == 3 * per_seq


# ------------------------------------------------------------------ bytes


def test_decode_bytes_dense_batch_one() -> None:
    c, t, b = LLAMA8B, 1024, 2
    # Every weight except the input embedding table, plus one embedding row (untied model).
    weights = b * (fl.param_count(c) - c.vocab_size * c.d_model + c.d_model)
    kv = fl.kv_bytes_per_token(c, b) * (t + 1)  # read T cached entries, write the new one
    assert fl.decode_bytes(c, [t], dtype_bytes=b) == weights + kv
    assert fl.decode_bytes(c, [t], 2, kv_dtype_bytes=1) == weights + kv / 2


def test_moe_decode_bytes_grow_with_batch_and_saturate() -> None:
    one = fl.decode_bytes(QWEN_MOE, [100])
    many = fl.decode_bytes(QWEN_MOE, [100] * 64)
    assert many > 5 * one  # a batch touches many more of the 128 experts
    assert fl.expected_distinct_experts(QWEN_MOE, 1) == pytest.approx(QWEN_MOE.top_k)
    assert fl.expected_distinct_experts(QWEN_MOE, 10_000) == QWEN_MOE.n_experts
    e, k = QWEN_MOE.n_experts, QWEN_MOE.top_k
    assert fl.expected_distinct_experts(QWEN_MOE, 4) == pytest.approx(e * (1 - (1 - k / e) ** 4))


def test_prefill_bytes_count_weights_once_and_kv() -> None:
    c, n = LLAMA8B, 2048
    weights = 2 * (fl.param_count(c) - c.vocab_size * c.d_model + n * c.d_model)
    assert fl.prefill_bytes(c, n) == weights + fl.kv_bytes_per_token(c) * n
    chunk = fl.prefill_bytes(c, 512, num_computed=n)
    assert chunk - fl.prefill_bytes(c, 512) == fl.kv_bytes_per_token(c) * n  # reads the cache


# ------------------------------------------------------------------ Dual-Flow


def test_dual_flow_decode_doubles_flops_not_bytes() -> None:
    base, dual = LLAMA8B, LLAMA8B.with_(arch="dual_flow")
    ctx = [1024]
    ratio = fl.decode_flops(dual, ctx) / fl.decode_flops(base, ctx)
    assert 1.9 < ratio < 2.0  # Fa/Fp = 1 - 2L*Pkv/Fp
    aux = 2 * base.n_layers * _paux(base) + 4 * base.n_layers * base.q_dim * 1025
    aux += 2 * base.d_model * base.vocab_size
    assert fl.decode_flops(dual, ctx) - fl.decode_flops(base, ctx) == aux
    byte_ratio = fl.decode_bytes(dual, ctx) / fl.decode_bytes(base, ctx)
    assert byte_ratio == pytest.approx(1.0, rel=0.01)
    extra = 2 * (base.d_model + fl.coupling_param_count(dual))  # aux embedding row + couplings
    assert fl.decode_bytes(dual, ctx) - fl.decode_bytes(base, ctx) == extra
    assert fl.kv_bytes_per_token(dual) == fl.kv_bytes_per_token(base)


def test_dual_flow_prefill_adds_one_aux_position() -> None:
    base, dual, n = LLAMA8B, LLAMA8B.with_(arch="dual_flow"), 2048
    aux = 2 * base.n_layers * _paux(base) + 4 * base.n_layers * base.q_dim * n
    aux += 2 * base.d_model * base.vocab_size
    assert fl.prefill_flops(dual, n) - fl.prefill_flops(base, n) == aux


def test_moe_replay_adds_no_expert_bytes() -> None:
    ctx = [512] * 8
    base = QWEN_MOE
    replay = base.with_(arch="dual_flow", aux_routing="replay")
    extra = 2 * (len(ctx) * base.d_model + fl.coupling_param_count(replay))
    assert fl.decode_bytes(replay, ctx) - fl.decode_bytes(base, ctx) == pytest.approx(extra)
    independent = base.with_(arch="dual_flow", aux_routing="independent")
    assert fl.decode_bytes(independent, ctx) > fl.decode_bytes(replay, ctx) + 1e8


def test_moe_aux_fan_out_uses_aux_k() -> None:
    dual = QWEN_MOE.with_(arch="dual_flow", aux_top_k=4)
    wider = QWEN_MOE.with_(arch="dual_flow", aux_top_k=12)
    expert_flops = 2 * QWEN_MOE.n_layers * 3 * QWEN_MOE.d_model * QWEN_MOE.d_expert
    diff = fl.decode_flops(wider, [100]) - fl.decode_flops(dual, [100])
    assert diff == 8 * expert_flops
    k1, k2, e = QWEN_MOE.top_k, 4, QWEN_MOE.n_experts
    union = fl.expected_distinct_experts(dual, 1, 1)
    assert union == pytest.approx(k1 + k2 - k1 * k2 / e)  # independent picks overlap a little


# ------------------------------------------------------------------ step cost


def test_step_cost_mixed_batch() -> None:
    chunks, ctx = [(512, 0), (100, 300)], [10, 20, 30]
    step = fl.step_cost(LLAMA8B, chunks, ctx)
    assert step.phase == "mixed"
    assert (step.num_prefill_tokens, step.num_decode_tokens) == (612, 3)
    assert step.flops == pytest.approx(step.prefill.flops + step.decode.flops)
    assert max(step.prefill.bytes, step.decode.bytes) < step.bytes
    assert step.bytes < step.prefill.bytes + step.decode.bytes  # weights read once
    expected = fl.prefill_flops(LLAMA8B, 512) + fl.prefill_flops(LLAMA8B, 100, num_computed=300)
    assert step.prefill.flops == expected
    assert step.decode.flops == fl.decode_flops(LLAMA8B, ctx)
    assert step.decode.bytes == fl.decode_bytes(LLAMA8B, ctx)


def test_step_cost_phases_and_idle() -> None:
    assert fl.step_cost(TINY, [(8, 0)], []).phase == "prefill"
    assert fl.step_cost(TINY, [], [3]).phase == "decode"
    idle = fl.step_cost(TINY, [], [])
    assert idle.phase == "idle"
    assert (idle.flops, idle.bytes, idle.intensity) == (0.0, 0.0, 0.0)


def test_step_cost_is_cheap_for_long_prompts_and_big_batches() -> None:
    start = time.perf_counter()
    for _ in range(200):
        fl.step_cost(QWEN_MOE, [(1_000_000, 0)], list(range(256)))
    assert time.perf_counter() - start < 1.0  # closed forms: no per-token loops


# ------------------------------------------------------------------ errors and purity


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(fl.CostError, match="logits_positions"):
        fl.prefill_flops(TINY, 4, logits_positions=5)
    with pytest.raises(fl.CostError):
        fl.prefill_flops(TINY, 0)
    with pytest.raises(fl.CostError, match=">= 0"):
        fl.decode_flops(TINY, [-1])
    with pytest.raises(fl.CostError, match="bytes"):
        fl.arithmetic_intensity(1.0, 0.0)
    with pytest.raises(ValueError):
        fl.decode_bytes(TINY, [1], dtype_bytes=0)
    assert fl.arithmetic_intensity(10.0, 4.0) == 2.5


def test_audit_math_imports_no_torch() -> None:
    code = (
        "import sys, splitphase.audit.flops, splitphase.audit.roofline; "
        "assert 'torch' not in sys.modules, 'audit math must stay torch-free'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
