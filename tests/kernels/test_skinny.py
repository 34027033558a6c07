"""The native decode kernel against torch's linear, and the model with it against without it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from splitphase.kernels import amx, build, packed_gemms, packed_linear, skinny
from splitphase.model.config import ModelConfig
from splitphase.model.transformer import Transformer

needs_kernel = pytest.mark.skipif(
    not build.available(), reason=f"native kernel unavailable: {build.status().reason}"
)


@pytest.fixture
def kernel_off():
    skinny.set_enabled(False)
    yield
    skinny.set_enabled(True)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 16, 23, 48])
@pytest.mark.parametrize("in_features", [64, 100, 768, 1800])
def test_fp32_matches_torch_linear(rows: int, in_features: int) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + in_features)
    x = torch.randn(rows, in_features, generator=g)
    ws = [torch.randn(n, in_features, generator=g) for n in (37, 256, 5)]
    with torch.inference_mode():
        got = skinny.linears(x, *ws)
    for y, w in zip(got, ws, strict=True):
        assert y.shape == (rows, w.shape[0]) and y.is_contiguous()
        torch.testing.assert_close(y, F.linear(x, w), atol=1e-4, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 5, 16])
def test_bf16_within_one_rounding_of_torch(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 768, generator=g).bfloat16()
    w = (torch.randn(300, 768, generator=g) * 0.05).bfloat16()
    with torch.inference_mode():
        got = torch.ops.splitphase.skinny_linear(x, [w])[0]  # the kernel, past MAX_ROWS too
    exact = x.float() @ w.float().T
    assert got.dtype == torch.bfloat16
    # fp32 accumulation, one bf16 rounding at the end: within one bf16 ulp (2**-7 relative).
    torch.testing.assert_close(got.float(), exact, rtol=2**-7, atol=1e-3)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features", [100, 1800])  # 1800: blocks of k, a tail in the last
def test_row_results_do_not_depend_on_row_count(dtype: torch.dtype, in_features: int) -> None:
    """Batch-invariant decode: a row's result is the same whether it is alone, in a tile of
    four, or in a batch the tiles do not divide; on an AVX2 build, within each side of
    OUTER_MIN_ROWS (the outer-product tile sums in another order)."""
    g = torch.Generator().manual_seed(0)
    rows = 23
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    ws = [torch.randn(n, in_features, generator=g).to(dtype) for n in (50, 7)]
    low = skinny.OUTER_MIN_ROWS - 1 if skinny.outer_tile() else rows
    with torch.inference_mode():
        full = torch.ops.splitphase.skinny_linear(x, ws)
        head = torch.ops.splitphase.skinny_linear(x[:low], ws)  # the dot tile's side
        tail = torch.ops.splitphase.skinny_linear(x[rows - low:], ws)
        for n in range(1, rows):
            for y, f, h in zip(torch.ops.splitphase.skinny_linear(x[:n], ws), full, head,
                               strict=True):
                assert torch.equal(y, f[:n] if n > low else h[:n])
            for y, f, t in zip(torch.ops.splitphase.skinny_linear(x[n:], ws), full, tail,
                               strict=True):
                assert torch.equal(y, f[n:] if rows - n > low else t[low - (rows - n):])


@pytest.mark.skipif(not skinny.outer_tile(), reason="no AVX2 outer-product tile in this build")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features", [1800, 1024])  # 1024: fp32 rows 4 KiB apart alias in L1
def test_outer_tile_is_exact_to_rounding_row_count_invariant_and_used(
    dtype: torch.dtype, in_features: int
) -> None:
    """64 rows (the most a call takes), k in blocks (the last partial), weights whose rows the
    tiles do not divide; row counts that leave 8 rows to the narrow tile (17, 37, 52) or
    none."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(64, in_features, generator=g).to(dtype)
    ws = [torch.randn(n, in_features, generator=g).to(dtype) for n in (50, 7, 13)]
    with torch.inference_mode():
        full = torch.ops.splitphase.skinny_linear(x, ws)
        for y, w in zip(full, ws, strict=True):
            exact = x.double() @ w.double().T
            tol = 1e-4 if dtype == torch.float32 else 2**-7
            torch.testing.assert_close(y.double(), exact, rtol=tol, atol=tol * 40)
        for n in range(skinny.OUTER_MIN_ROWS, 64, 5):
            for y, f in zip(torch.ops.splitphase.skinny_linear(x[:n], ws), full, strict=True):
                assert torch.equal(y, f[:n])
        try:  # the tile gave those: with it off the dot tile sums in another order
            torch.ops.splitphase.set_outer_min_rows(0)
            dot = torch.ops.splitphase.skinny_linear(x, ws)
            torch.ops.splitphase.set_outer_min_rows(8)  # 8 rows: the narrow tile alone
            eight = torch.ops.splitphase.skinny_linear(x[:8], ws)
        finally:
            torch.ops.splitphase.set_outer_min_rows(skinny.OUTER_MIN_ROWS)
        assert all(torch.equal(y, f[:8]) for y, f in zip(eight, full, strict=True))
        if dtype == torch.float32:  # bf16's rounding of the output can hide the difference
            assert not all(torch.equal(a, f) for a, f in zip(dot, full, strict=True))


@needs_kernel
def test_kernel_is_used_for_decode_rows_only(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = torch.ops.splitphase.skinny_linear

    def spy(x: torch.Tensor, ws: list[torch.Tensor], pass_rows: int) -> list[torch.Tensor]:
        calls.append(x.shape[0])
        return real(x, ws, pass_rows)

    monkeypatch.setattr(skinny, "_native", spy)
    w = torch.randn(8, 32)
    with torch.inference_mode():
        skinny.linear(torch.randn(1, 3, 32), w)
        # Past max_rows a packed GEMM comes first; a call it left (the packing budget full)
        # still takes the kernel up to own_rows (MAX_ROWS, or all its rows with the AVX2
        # outer-product tile).
        fp32_rows = skinny.own_rows(torch.float32)
        skinny.linear(torch.randn(fp32_rows, 32), w)
        skinny.linear(torch.randn(fp32_rows + 1, 32), w)  # above: torch
        above_bf16 = torch.randn(skinny.own_rows(torch.bfloat16) + 1, 32).bfloat16()
        skinny.linear(above_bf16, w.bfloat16())  # above the bf16 limit: torch
        skinny.linear(torch.randn(2, 32).half(), w.half())  # fp16: torch
    assert fp32_rows == (skinny.KERNEL_ROWS if skinny.outer_tile() else
                         skinny.MAX_ROWS[torch.float32])
    assert calls == [3, fp32_rows]


@pytest.mark.skipif(packed_linear.backends() != ["mkl", "onednn"], reason="needs both GEMMs")
def test_kernel_hands_over_to_onednn_earlier_than_to_mkl() -> None:
    fp32, bf16 = torch.float32, torch.bfloat16
    with packed_linear.using_backend("onednn"):
        assert skinny.max_rows(fp32) == packed_linear.ONEDNN_MIN_ROWS - 1
        if packed_gemms.takes("onednn", bf16):
            assert skinny.max_rows(bf16) == packed_linear.min_rows(bf16) - 1
        assert packed_linear.min_rows(fp32) == packed_linear.ONEDNN_MIN_ROWS
        with packed_linear.switched(False):
            assert skinny.max_rows(fp32) == skinny.own_rows(fp32)
    with packed_linear.using_backend("mkl"):
        assert skinny.max_rows(fp32) == skinny.own_rows(fp32)
        assert packed_linear.min_rows(fp32) == packed_linear.MIN_ROWS
        if packed_gemms.takes("onednn", bf16):
            bf16_from = (packed_linear.AMX_BF16_MIN_ROWS if amx.AMX_TILES
                         else packed_linear.ONEDNN_MIN_ROWS)
            assert packed_linear.min_rows(bf16) == bf16_from  # bf16: oneDNN's
        else:  # no bf16 packed GEMM on this CPU: the kernel keeps its own rows
            assert packed_linear.backend_for(bf16) is None
            assert skinny.max_rows(bf16) == skinny.own_rows(bf16)


@needs_kernel
def test_bf16_keeps_the_kernel_to_its_limit_where_no_gemm_packs_bf16(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bf16 = torch.bfloat16
    monkeypatch.setattr(skinny, "_amx_kernel", False)
    monkeypatch.setattr(packed_linear, "backend_for", lambda dtype: None)
    fp32_rows = skinny.KERNEL_ROWS if skinny.outer_tile() else skinny.MAX_ROWS[torch.float32]
    monkeypatch.setattr(skinny, "_outer_tile", True)  # an AVX2 build (the Zen 3 host)
    assert skinny.own_rows(bf16) == skinny.max_rows(bf16) == skinny.KERNEL_ROWS
    monkeypatch.setattr(skinny, "_outer_tile", fp32_rows == skinny.KERNEL_ROWS)
    assert skinny.own_rows(torch.float32) == fp32_rows
    monkeypatch.setattr(skinny, "_outer_tile", True)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(skinny.KERNEL_ROWS, 96, generator=g).bfloat16()
    w = (torch.randn(40, 96, generator=g) * 0.1).bfloat16()
    with torch.inference_mode():
        assert skinny._use_kernel(x, (w,))
        y = skinny.linear(x, w)
        torch.testing.assert_close(y.float(), x.float() @ w.float().T, rtol=2**-7, atol=1e-3)
        assert not skinny._use_kernel(torch.randn(skinny.KERNEL_ROWS + 1, 96).bfloat16(), (w,))
    monkeypatch.setattr(packed_linear, "backend_for", lambda dtype: "onednn")
    assert skinny.own_rows(bf16) == skinny.MAX_ROWS[bf16]


@needs_kernel
def test_without_the_outer_tile_bf16_hands_over_to_the_widened_gemm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # AVX-512 without bf16 instructions: past 31 rows the fp32 packed GEMM on bf16 widened.
    bf16 = torch.bfloat16
    monkeypatch.setattr(skinny, "_amx_kernel", False)
    monkeypatch.setattr(skinny, "_outer_tile", False)
    monkeypatch.setattr(packed_linear, "backend_for", lambda dtype: None)
    if packed_linear.widened_backend(bf16) is None:
        pytest.skip("this torch has no fp32 packed GEMM to widen to")
    assert skinny.own_rows(bf16) == skinny.max_rows(bf16) == packed_linear.MIN_ROWS - 1
    assert packed_linear.min_rows(bf16) == packed_linear.MIN_ROWS  # no rows left between
    monkeypatch.setattr(packed_linear, "widened_backend", lambda dtype: None)
    assert skinny.own_rows(bf16) == skinny.KERNEL_ROWS  # torch's bf16 linear: the kernel


@pytest.mark.skipif(not packed_gemms.takes("onednn", torch.bfloat16),
                    reason="needs oneDNN's bf16 GEMM")
@pytest.mark.parametrize("has_amx", [False, True])
def test_bf16_stays_on_the_kernel_to_its_own_rows_where_onednn_has_amx(
    has_amx: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The two modules' bounds meet: oneDNN takes bf16 where the kernel's tiles stop.
    assert packed_linear.AMX_BF16_MIN_ROWS == skinny.AMX_MAX_ROWS + 1
    monkeypatch.setattr(amx, "AMX_TILES", has_amx)
    bf16, fp32 = torch.bfloat16, torch.float32
    with packed_linear.using_backend("onednn"):
        want = packed_linear.AMX_BF16_MIN_ROWS if has_amx else packed_linear.ONEDNN_MIN_ROWS
        assert packed_linear.min_rows(bf16) == want
        assert packed_linear.min_rows(fp32) == packed_linear.ONEDNN_MIN_ROWS  # fp32: no AMX
        assert skinny.max_rows(bf16) == min(want - 1, skinny.own_rows(bf16))
        x, w = torch.randn(want - 1, 32).bfloat16(), torch.randn(16, 32).bfloat16()
        assert not packed_linear.usable(x, w)
        assert packed_linear.usable(torch.randn(want, 32).bfloat16(), w)


@pytest.mark.skipif(not skinny.amx_kernel(), reason="the kernel has no AMX tiles here")
def test_bf16_on_amx_tiles_is_exact_to_one_rounding_and_batch_and_thread_invariant() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(skinny.AMX_MAX_ROWS, 768, generator=g).bfloat16()
    ws = [(torch.randn(n, 768, generator=g) * 0.05).bfloat16() for n in (768, 32, 256)]
    with torch.inference_mode():
        full = torch.ops.splitphase.skinny_linear(x, ws)
        for y, w in zip(full, ws, strict=True):
            exact = x.float() @ w.float().T
            torch.testing.assert_close(y.float(), exact, rtol=2**-7, atol=1e-3)
        for n in range(skinny.AMX_MIN_ROWS, skinny.AMX_MAX_ROWS):
            for y, f in zip(torch.ops.splitphase.skinny_linear(x[:n], ws), full, strict=True):
                assert torch.equal(y, f[:n])
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            alone = torch.ops.splitphase.skinny_linear(x, ws)
        finally:
            torch.set_num_threads(threads)
        assert all(torch.equal(a, f) for a, f in zip(alone, full, strict=True))
        try:  # the tiles, not VDPBF16PS, gave those: with them off the sums differ
            torch.ops.splitphase.set_amx_min_rows(0)
            plain = torch.ops.splitphase.skinny_linear(x, ws)
        finally:
            torch.ops.splitphase.set_amx_min_rows(skinny.AMX_MIN_ROWS)
        assert not all(torch.equal(a, f) for a, f in zip(plain, full, strict=True))


@needs_kernel
def test_pass_rows_pick_the_threads_not_the_result() -> None:
    x, w = torch.randn(3, 96), torch.randn(200, 96)
    with torch.inference_mode():
        alone = skinny.linear(x, w)
        after_prefill = skinny.linear(x, w, pass_rows=512)  # on torch's OpenMP team
    assert torch.equal(alone, after_prefill)


@needs_kernel
def test_a_prefill_hands_its_tokens_to_the_lm_head(
    monkeypatch: pytest.MonkeyPatch, tiny_model: Transformer
) -> None:
    model = tiny_model
    seen: list[tuple[int, int]] = []
    real = skinny._native

    def spy(x: torch.Tensor, ws: list[torch.Tensor], pass_rows: int) -> list[torch.Tensor]:
        seen.append((x.shape[0], pass_rows))
        return real(x, ws, pass_rows)

    _, cache = model.prefill(torch.randint(0, 100, (2, 9)))
    monkeypatch.setattr(skinny, "_native", spy)
    model.prefill(torch.randint(0, 100, (2, 5)), model.new_cache(2, 16))
    assert seen[-1] == (2, 10)  # the LM head's two rows end a 10-token pass
    seen.clear()
    model.decode_step(torch.tensor([1, 2]), cache)
    assert seen and seen[-1] == (2, 2)  # a decode step's head stays decode-shaped


def test_fallback_is_exactly_torch(kernel_off: None) -> None:
    x, w1, w2 = torch.randn(2, 1, 40), torch.randn(12, 40), torch.randn(6, 40)
    a, b = skinny.linears(x, w1, w2)
    assert torch.equal(a, F.linear(x, w1)) and torch.equal(b, F.linear(x, w2))
    assert torch.equal(skinny.swiglu(x, w1, w1), F.silu(F.linear(x, w1)) * F.linear(x, w1))


def test_autograd_takes_torch_path() -> None:
    w = torch.randn(4, 8, requires_grad=True)
    skinny.linear(torch.randn(1, 8), w).sum().backward()
    assert w.grad is not None


@needs_kernel
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_decode_matches_reference_path(dtype: str) -> None:
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name("tiny").with_(dtype=dtype)).eval()
    prompt = list(range(3, 40))
    fast = model.generate(prompt, 24)
    ids = torch.tensor([prompt, prompt[::-1]])
    logits_fast, cache = model.prefill(ids)
    steps_fast = [model.decode_step(ids[:, i], cache) for i in range(4)]
    skinny.set_enabled(False)
    try:
        ref = model.generate(prompt, 24)
        logits_ref, cache = model.prefill(ids)
        steps_ref = [model.decode_step(ids[:, i], cache) for i in range(4)]
    finally:
        skinny.set_enabled(True)
    assert fast == ref
    tol = 1e-5 if dtype == "float32" else 3e-2
    torch.testing.assert_close(logits_fast, logits_ref, atol=tol, rtol=tol)
    for a, b in zip(steps_fast, steps_ref, strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


@pytest.mark.skipif(not skinny.amx_kernel(), reason="the kernel has no AMX tiles here")
def test_model_decode_of_a_tile_sized_batch_matches_the_reference_path() -> None:
    torch.manual_seed(0)
    # Wide enough that the tiles' sums, rounded to bf16, differ somewhere from VDPBF16PS's.
    cfg = ModelConfig.from_name("tiny").with_(dtype="bfloat16", d_model=256, d_ff=512,
                                              head_dim=64)
    model = Transformer(cfg).eval()
    ids = torch.randint(3, model.cfg.vocab_size, (skinny.AMX_MIN_ROWS + 3, 20))

    def steps() -> list[torch.Tensor]:
        _, cache = model.prefill(ids)
        return [model.decode_step(ids[:, i], cache) for i in range(3)]

    with torch.inference_mode():
        tiles = steps()
        try:
            torch.ops.splitphase.set_amx_min_rows(0)
            plain = steps()
        finally:
            torch.ops.splitphase.set_amx_min_rows(skinny.AMX_MIN_ROWS)
        with skinny.switched(False):
            ref = steps()
    assert not all(torch.equal(a, b) for a, b in zip(tiles, plain, strict=True))  # tiles ran
    for a, b in zip(tiles, ref, strict=True):
        torch.testing.assert_close(a, b, atol=3e-2, rtol=3e-2)


@needs_kernel
def test_a_forked_child_runs_the_kernel_with_its_own_helpers() -> None:
    import os

    x, w = torch.randn(3, 256), torch.randn(4096, 256)
    with torch.inference_mode():
        expected = skinny.linear(x, w)  # the parent's helpers exist now
        pid = os.fork()
        if pid == 0:  # child: must neither hang nor crash, and must agree
            ok = torch.equal(skinny.linear(x, w), expected)
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
