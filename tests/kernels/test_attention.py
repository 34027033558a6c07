"""Native decode attention against gather + SDPA, and the cache paths that use it."""

from __future__ import annotations

import pytest
import torch

from splitphase.kernels import build, skinny
from splitphase.kernels.attention import decode_attention
from splitphase.model.config import ModelConfig
from splitphase.model.transformer import Transformer

needs_kernel = pytest.mark.skipif(
    not build.available(), reason=f"native kernel unavailable: {build.status().reason}"
)


def _case(dtype: torch.dtype, heads: int, groups: int, dim: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    pool = 300
    q = torch.randn(4, heads, dim, generator=g).to(dtype)
    k = torch.randn(pool, groups, dim, generator=g).to(dtype)
    v = torch.randn(pool, groups, dim, generator=g).to(dtype)
    lengths = torch.tensor([1, 57, 120, 16])
    slots = torch.randint(0, pool, (4, 120), generator=g)  # padded: only lengths[b] are read
    return q, k, v, slots, lengths


def _torch_path(*args: torch.Tensor) -> torch.Tensor:
    skinny.set_enabled(False)
    try:
        return decode_attention(*args)
    finally:
        skinny.set_enabled(True)


@needs_kernel
@pytest.mark.parametrize(("heads", "groups", "dim"), [(4, 4, 16), (12, 4, 64), (6, 2, 24)])
def test_fp32_matches_gather_and_sdpa(heads: int, groups: int, dim: int) -> None:
    args = _case(torch.float32, heads, groups, dim)
    with torch.inference_mode():
        got = decode_attention(*args)
    assert got.shape == (4, heads, dim)
    torch.testing.assert_close(got, _torch_path(*args), atol=2e-6, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize(("heads", "groups", "dim"), [(12, 4, 64), (6, 2, 24), (8, 1, 64)])
def test_long_contexts_match_gather_and_sdpa(heads: int, groups: int, dim: int) -> None:
    # Past the short cases above: the prefetches ahead, the value walk in registers (64), axpy
    # for a head_dim tail (24) and for 8 query heads a K/V head, over up to 1000 slots.
    g = torch.Generator().manual_seed(11)
    pool, lengths = 1200, torch.tensor([128, 129, 300, 385, 1000])
    q = torch.randn(len(lengths), heads, dim, generator=g)
    k, v = (torch.randn(pool, groups, dim, generator=g) for _ in range(2))
    slots = torch.stack([torch.randperm(pool, generator=g)[:1000] for _ in lengths])
    with torch.inference_mode():
        got = decode_attention(q, k, v, slots, lengths)
    torch.testing.assert_close(got, _torch_path(q, k, v, slots, lengths), atol=2e-6, rtol=1e-5)


@needs_kernel
def test_bf16_matches_within_bf16_rounding() -> None:
    args = _case(torch.bfloat16, 12, 4, 64, seed=3)
    with torch.inference_mode():
        got = decode_attention(*args)
    ref = decode_attention(*(a.float() if a.is_floating_point() else a for a in args))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)


# The pool's own rounding: how far attention over it may land from attention over fp32 K/V.
POOL_ROUNDING = {torch.bfloat16: 3e-2, torch.float8_e4m3fn: 0.15, torch.float8_e5m2: 0.3}


@needs_kernel
@pytest.mark.parametrize("pool_dtype", list(POOL_ROUNDING))
@pytest.mark.parametrize(("heads", "groups", "dim"), [(12, 4, 64), (6, 2, 24)])
def test_fp32_queries_over_a_narrower_pool_read_the_pools_values_exactly(
    heads: int, groups: int, dim: int, pool_dtype: torch.dtype
) -> None:
    # kv_cache_dtype="bfloat16" or "fp8" under an fp32 model: the native kernel widens each
    # stored value, so it agrees with fp32 attention over the pool's values widened up front.
    q, k, v, slots, lengths = _case(torch.float32, heads, groups, dim, seed=5)
    kb, vb = k.to(pool_dtype), v.to(pool_dtype)
    with torch.inference_mode():
        got = decode_attention(q, kb, vb, slots, lengths)
        assert got.dtype == torch.float32
        ref = decode_attention(q, kb.float(), vb.float(), slots, lengths)
        torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(_torch_path(q, kb, vb, slots, lengths), ref,
                                   atol=2e-6, rtol=1e-5)
        # and the pool's rounding is all that separates it from fp32 K/V
        tol = POOL_ROUNDING[pool_dtype]
        torch.testing.assert_close(got, decode_attention(q, k, v, slots, lengths),
                                   atol=tol, rtol=tol)


@needs_kernel
@pytest.mark.parametrize("pool_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_every_finite_fp8_value_is_widened_exactly(pool_dtype: torch.dtype) -> None:
    # One key: its softmax weight is exactly 1, so the output is its V row as the kernel
    # widened it. The 256 codes fill one slot (4 K/V heads of 64); NaN and infinity codes,
    # which a pool never holds (casts saturate), are zeroed.
    codes = torch.arange(256, dtype=torch.uint8)
    codes[~torch.isfinite(codes.view(pool_dtype).float())] = 0
    v = codes.view(pool_dtype).view(1, 4, 64)
    k = torch.ones(1, 4, 64).to(pool_dtype)
    q = torch.randn(1, 12, 64)
    one = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long)
    with torch.inference_mode():
        got = decode_attention(q, k, v, *one)
    want = v.float().repeat_interleave(3, dim=1)  # the three query heads of each K/V head
    assert torch.equal(got, want)


@needs_kernel
@pytest.mark.parametrize(("heads", "groups", "dim"), [(12, 4, 64), (6, 2, 24)])
def test_a_row_does_not_depend_on_its_batch_or_the_thread_count(
    heads: int, groups: int, dim: int
) -> None:
    """Jobs split a sequence's K/V heads when the batch is smaller than the thread count; a
    row's result is the same whichever split, batch or thread count computed it."""
    q, k, v, slots, lengths = _case(torch.float32, heads, groups, dim, seed=5)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            with torch.inference_mode():
                results.append(decode_attention(q, k, v, slots, lengths))
                alone = [decode_attention(q[i:i + 1], k, v, slots[i:i + 1], lengths[i:i + 1])
                         for i in range(len(q))]
            assert torch.equal(torch.cat(alone), results[0])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(r, results[0]) for r in results)


@needs_kernel
def test_padding_slots_are_never_read() -> None:
    q, k, v, slots, lengths = _case(torch.float32, 4, 2, 16)
    poisoned = slots.clone()
    for b, n in enumerate(lengths.tolist()):
        poisoned[b, n:] = 10**9  # out of the pool: reading one would crash or give garbage
    with torch.inference_mode():
        torch.testing.assert_close(
            decode_attention(q, k, v, poisoned, lengths), decode_attention(q, k, v, slots, lengths)
        )


@needs_kernel
def test_contiguous_cache_decode_matches_sdpa() -> None:
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name("tiny")).eval()
    ids = torch.randint(0, 512, (3, 20))
    _, cache = model.prefill(ids[:, :12])
    fast = [model.decode_step(ids[:, t], cache) for t in range(12, 20)]
    skinny.set_enabled(False)
    try:
        _, cache = model.prefill(ids[:, :12])
        ref = [model.decode_step(ids[:, t], cache) for t in range(12, 20)]
    finally:
        skinny.set_enabled(True)
    for a, b in zip(fast, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
