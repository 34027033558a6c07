import math

import torch

from splitphase.model.config import ModelConfig
from splitphase.model.layers import (
    Attention,
    RMSNorm,
    SwiGLU,
    apply_rope,
    causal_mask,
    rope_cos_sin,
)
from splitphase.model.moe import MoE


def test_rmsnorm_matches_formula():
    norm = RMSNorm(8, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.arange(1.0, 9.0))
    x = torch.randn(3, 8)
    expected = x / torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    torch.testing.assert_close(norm(x), expected)


def test_rope_matches_direct_rotation():
    # Pair i of the rotate-half layout is (x[i], x[i + D/2]) rotated by pos * theta^(-2i/D).
    head_dim, theta = 8, 10000.0
    x = torch.randn(1, 5, 2, head_dim)
    positions = torch.arange(5)
    cos, sin = rope_cos_sin(positions, head_dim, theta, torch.float32)
    got = apply_rope(x, cos[None, :, None], sin[None, :, None])
    expected = torch.empty_like(x)
    half = head_dim // 2
    for p in range(5):
        for i in range(half):
            angle = p * theta ** (-2 * i / head_dim)
            a, b = x[0, p, :, i], x[0, p, :, i + half]
            expected[0, p, :, i] = a * math.cos(angle) - b * math.sin(angle)
            expected[0, p, :, i + half] = a * math.sin(angle) + b * math.cos(angle)
    torch.testing.assert_close(got, expected)


def test_rope_preserves_norm_and_relative_positions():
    head_dim = 16
    q, k = torch.randn(head_dim), torch.randn(head_dim)

    def rot(x, pos):
        cos, sin = rope_cos_sin(torch.tensor([pos]), head_dim, 10000.0, torch.float32)
        return apply_rope(x[None, None, None], cos[None, :, None], sin[None, :, None]).flatten()

    torch.testing.assert_close(rot(q, 7).norm(), q.norm())
    torch.testing.assert_close(rot(q, 3) @ rot(k, 1), rot(q, 12) @ rot(k, 10), atol=1e-5, rtol=1e-5)


def test_attention_shapes_and_gqa_equals_expanded_mha():
    cfg = ModelConfig.from_name("tiny")  # 4 query heads, 2 kv heads
    attn = Attention(cfg, torch.float32)
    x = torch.randn(2, 6, cfg.d_model)
    cos, sin = rope_cos_sin(torch.arange(6), cfg.head_dim, cfg.rope_theta, torch.float32)
    cos, sin = cos[None, :, None], sin[None, :, None]
    q = attn.project_q(x, cos, sin)
    k, v = attn.project_kv(x, cos, sin)
    assert q.shape == (2, 6, 4, 16) and k.shape == v.shape == (2, 6, 2, 16)
    out = attn.attend(q, k, v, mask=None, causal=True)
    assert out.shape == (2, 6, 64)
    # Multi-head attention with each kv head copied to its query group gives the same result.
    mha_cfg = cfg.with_(n_kv_heads=4)
    mha = Attention(mha_cfg, torch.float32)
    k_exp, v_exp = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    torch.testing.assert_close(mha.attend(q, k_exp, v_exp, mask=None, causal=True), out)


def test_causal_mask_for_chunk_with_history():
    mask = causal_mask(2, 5, torch.device("cpu"))
    assert mask.tolist() == [[True, True, True, True, False], [True] * 5]


def test_swiglu_shape_and_formula():
    mlp = SwiGLU(8, 12, torch.float32)
    x = torch.randn(3, 8)
    expected = mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    torch.testing.assert_close(mlp(x), expected)
    assert mlp.intermediate(x).shape == (3, 12)


def test_moe_routes_exactly_top_k_and_matches_dense_loop():
    cfg = ModelConfig.from_name("tiny-moe")
    moe = MoE(cfg, torch.float32)
    x = torch.randn(10, cfg.d_model)
    weights, idx = moe.route(x)
    assert idx.shape == (10, cfg.top_k)
    assert all(len(set(row)) == cfg.top_k for row in idx.tolist())
    torch.testing.assert_close(weights.sum(-1), torch.ones(10))
    expected = moe.shared(x).clone()
    for n in range(10):
        for j in range(cfg.top_k):
            e = int(idx[n, j])
            h = torch.nn.functional.silu(x[n] @ moe.gate[e].T) * (x[n] @ moe.up[e].T)
            expected[n] += weights[n, j] * (h @ moe.down[e].T)
    torch.testing.assert_close(moe(x), expected, atol=1e-6, rtol=1e-5)
    assert moe.route(x, top_k=1)[1].shape == (10, 1)
