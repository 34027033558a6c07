"""Native RMSNorm (and its residual add), RoPE and SiLU*mul against the torch reference."""

from __future__ import annotations

import pytest
import torch

from splitphase.kernels import build, elementwise, skinny
from splitphase.model.layers import RMSNorm, apply_rope, rope_cos_sin

needs_kernel = pytest.mark.skipif(
    not build.available(), reason=f"native kernel unavailable: {build.status().reason}"
)


def _both(fn):
    with torch.inference_mode():
        fast = fn()
        skinny.set_enabled(False)
        try:
            ref = fn()
        finally:
            skinny.set_enabled(True)
    return fast, ref


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_reference(dtype: torch.dtype) -> None:
    norm = RMSNorm(96, 1e-5, dtype)
    with torch.no_grad():
        norm.weight.normal_()
    x = (torch.randn(3, 7, 96) * 3).to(dtype)
    fast, ref = _both(lambda: norm(x))
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert fast.dtype == dtype and fast.shape == x.shape
    torch.testing.assert_close(fast.float(), ref.float(), atol=tol, rtol=tol)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_batch", [False, True])
@pytest.mark.parametrize("d", [16, 64, 80])  # half a head: a partial vector, two, two and a part
def test_rope_is_bit_exact(dtype: torch.dtype, per_batch: bool, d: int) -> None:
    b, t, h = 2, 5, 3
    pos = torch.arange(t).repeat(b, 1) + (torch.arange(b)[:, None] * 7 if per_batch else 0)
    cos, sin = rope_cos_sin(pos if per_batch else pos[:1], d, 10000.0, dtype)  # (B|1, T, D)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # (B|1, T, 1, D)
    x = torch.randn(b, t, h, d).to(dtype)
    fast, ref = _both(lambda: apply_rope(x, cos, sin))
    assert torch.equal(fast, ref)  # same operations, same order, same roundings


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [5, 1])  # 1: a decode step's rows, one position each
def test_rope_reads_a_column_slice_of_a_fused_projection_in_place(dtype: torch.dtype, t: int
                                                                  ) -> None:
    b, h, d, g = 3, 3, 16, 1
    cos, sin = rope_cos_sin(torch.arange(t), d, 10000.0, dtype)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]  # (1, T, 1, D)
    qkv = torch.randn(b, t, (h + 2 * g) * d).to(dtype)  # one GEMM's output: q | k | v columns
    for lo, heads in ((0, h), (h * d, g)):
        x = qkv[..., lo : lo + heads * d].unflatten(-1, (heads, d))  # (B, T, heads, D), strided
        assert not x.is_contiguous()
        with torch.inference_mode():
            assert elementwise.rope(x, cos, sin) is not None  # the native pass took it
        fast, ref = _both(lambda x=x: apply_rope(x, cos, sin))
        assert fast.is_contiguous() and torch.equal(fast, ref)
        assert torch.equal(fast, apply_rope(x.contiguous(), cos, sin))


def test_shapes_the_kernel_does_not_cover_fall_back() -> None:
    x = torch.randn(2, 5, 3, 16)[:, :, :, :8]  # not contiguous
    cos, sin = torch.ones(1, 5, 1, 8), torch.zeros(1, 5, 1, 8)
    with torch.inference_mode():
        assert torch.equal(apply_rope(x, cos, sin), x)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_nan_stays_a_nan_through_the_passes(dtype: torch.dtype) -> None:
    """The vector bf16 rounding must not carry a NaN into an infinity or a zero."""
    x = torch.randn(2, 3, 2, 64).to(dtype)
    x[0, 1, 1, 5] = float("nan")
    cos, sin = rope_cos_sin(torch.arange(3)[None], 64, 10000.0, dtype)
    y = elementwise.rope(x, cos[:, :, None, :], sin[:, :, None, :])
    assert y is not None and y[0, 1, 1].isnan().any() and not y[1].isnan().any()
    rows, r, w = x.reshape(12, 64), torch.randn(12, 64).to(dtype), torch.ones(64, dtype=dtype)
    fused = elementwise.add_rms_norm(rows, r, w, 1e-5)
    assert fused is not None
    s, normed = fused
    assert s[3, 5].isnan() and normed[3].isnan().all() and not normed[4].isnan().any()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_norm_is_the_add_then_the_native_norm(dtype: torch.dtype) -> None:
    norm = RMSNorm(100, 1e-5, dtype)
    with torch.no_grad():
        norm.weight.normal_()
    x, r = torch.randn(2, 9, 100).to(dtype), torch.randn(2, 9, 100).to(dtype)
    with torch.inference_mode():
        r_block = r.clone()
        s, y = norm.residual(x, r_block)
        assert s.data_ptr() == r_block.data_ptr()  # the sum is written over the block's output
        assert torch.equal(s, x + r) and torch.equal(y, norm(x + r))  # bit for bit
    (s_fast, y_fast), (s_ref, y_ref) = _both(lambda: norm.residual(x, r.clone()))
    assert torch.equal(s_fast, s_ref)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y_fast.float(), y_ref.float(), atol=tol, rtol=tol)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_torch_and_ignores_position(dtype: torch.dtype) -> None:
    g = (torch.randn(5, 172) * 8).to(dtype)  # wide enough for exp's clamp; 172: a ragged tail
    u = torch.randn(5, 172).to(dtype)
    fast, ref = _both(lambda: elementwise.silu_mul(g, u))
    assert fast.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # exp within 2 ulp; bf16 may round apart
    torch.testing.assert_close(fast.float(), ref.float(), atol=tol, rtol=tol)
    with torch.inference_mode():
        for row in range(5):  # a row alone takes the same code as inside the batch
            assert torch.equal(elementwise.silu_mul(g[row], u[row]), fast[row])
        g_out = g.clone()
        over = elementwise.silu_mul_(g_out, u)
        assert over.data_ptr() == g_out.data_ptr() and torch.equal(over, fast)
