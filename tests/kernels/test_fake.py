"""The native ops' fake implementations describe the real outputs: shape, dtype and strides."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from splitphase.kernels import build

needs_kernel = pytest.mark.skipif(
    not build.available(), reason=f"native kernel unavailable: {build.status().reason}"
)


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.dtype, t.stride()


def _compare(op: Callable, *args: object) -> None:
    real = op(*args)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fakes = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else (
            [mode.from_tensor(t) for t in a] if isinstance(a, list) else a) for a in args]
        fake = op(*fakes)
    reals = real if isinstance(real, (list, tuple)) else [real]
    fakes_out = fake if isinstance(fake, (list, tuple)) else [fake]
    assert [_layout(t) for t in fakes_out] == [_layout(t) for t in reals]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fakes_match_real_outputs(dtype: torch.dtype) -> None:
    ops = torch.ops.splitphase
    x = torch.randn(3, 5, 64, dtype=dtype)
    w = torch.randn(64, dtype=dtype)
    _compare(ops.rms_norm, x, w, 1e-5)
    _compare(ops.add_rms_norm, x, torch.randn_like(x), w, 1e-5)
    _compare(ops.silu_mul, x, torch.randn_like(x))
    _compare(ops.skinny_linear, x[0], [torch.randn(48, 64, dtype=dtype),
                                       torch.randn(16, 64, dtype=dtype)])
    qkv = torch.randn(1, 7, (4 + 2 * 2) * 16, dtype=dtype)  # a fused Q/K/V output
    q = qkv[..., : 4 * 16].unflatten(-1, (4, 16))  # (1, 7, 4, 16), rows 128 apart
    cos, sin = torch.randn(1, 7, 16, dtype=dtype), torch.randn(1, 7, 16, dtype=dtype)
    _compare(ops.rope, q, cos, sin)
