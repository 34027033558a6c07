"""Native RMSNorm and RoPE against the torch reference in `splitphase.model.layers`."""

from __future__ import annotations

import pytest
import torch

from splitphase.kernels import build, skinny
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
def test_rope_is_bit_exact(dtype: torch.dtype, per_batch: bool) -> None:
    b, t, h, d = 2, 5, 3, 16
    pos = torch.arange(t).repeat(b, 1) + (torch.arange(b)[:, None] * 7 if per_batch else 0)
    cos, sin = rope_cos_sin(pos if per_batch else pos[:1], d, 10000.0, dtype)  # (B|1, T, D)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # (B|1, T, 1, D)
    x = torch.randn(b, t, h, d).to(dtype)
    fast, ref = _both(lambda: apply_rope(x, cos, sin))
    assert torch.equal(fast, ref)  # same operations, same order, same roundings


def test_shapes_the_kernel_does_not_cover_fall_back() -> None:
    x = torch.randn(2, 5, 3, 16)[:, :, :, :8]  # not contiguous
    cos, sin = torch.ones(1, 5, 1, 8), torch.zeros(1, 5, 1, 8)
    with torch.inference_mode():
        assert torch.equal(apply_rope(x, cos, sin), x)
