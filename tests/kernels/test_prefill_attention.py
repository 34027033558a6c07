"""Native causal prefill attention against torch SDPA, and the model and engine paths using it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from splitphase.kernels import amx, build, prefill_attention
from splitphase.model.config import ModelConfig
from splitphase.model.transformer import Transformer

needs_kernel = pytest.mark.skipif(
    not build.available(), reason=f"native kernel unavailable: {build.status().reason}"
)


@pytest.fixture(autouse=True)
def scalar_tiles_too() -> Iterator[None]:
    """The kernel's results are tested whatever its speed here: where its tiles are scalar
    loops (no AVX-512) the model leaves it to SDPA, these tests still run it."""
    with prefill_attention.scalar_tiles_allowed():
        yield


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@needs_kernel
def test_the_kernel_takes_prefill_only_where_its_tiles_are_vector_code(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(prefill_attention, "_vectorized", None)  # as the library says
    flags = _cpu_flags()
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "bmi2"}
    want = avx512 <= flags or {"avx2", "fma"} <= flags
    assert prefill_attention.vectorized() == want
    assert prefill_attention.is_enabled() == want
    q, k, v = _qkv(1, 70, 70, 12, 4, 64)
    got = prefill_attention.causal(q, k, v)
    assert (got is not None) == want
    model = Transformer(ModelConfig.from_name("tiny")).eval()
    ids = torch.randint(0, model.cfg.vocab_size, (1, 40))
    with torch.inference_mode():
        logits, _ = model.prefill(ids)
        with prefill_attention.switched(False):
            torch.testing.assert_close(logits, model.prefill(ids)[0], atol=1e-4, rtol=1e-4)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q (B, T, H, D), the last T of the S positions of k/v (B, S, G, D) -> (B, T, H*D)."""
    t, s = q.shape[1], k.shape[1]
    groups = q.shape[2] // k.shape[2]
    mask = torch.arange(s)[None, :] <= torch.arange(s - t, s)[:, None]  # (T, S)
    k, v = k.repeat_interleave(groups, 2), v.repeat_interleave(groups, 2)  # (B, S, H, D)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
    )
    return out.transpose(1, 2).flatten(2)


def _qkv(b: int, t: int, s: int, heads: int, groups: int, dim: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, heads, dim, generator=g)
    k = torch.randn(b, s, groups, dim, generator=g)
    v = torch.randn(b, s, groups, dim, generator=g)
    return q, k, v


@needs_kernel
@pytest.mark.parametrize("n", [1, 7, 63, 64, 65, 130])
@pytest.mark.parametrize(("heads", "groups"), [(4, 4), (12, 4), (6, 2), (16, 2)])
def test_whole_prompt_matches_sdpa(n: int, heads: int, groups: int) -> None:
    q, k, v = _qkv(1, n, n, heads, groups, 64)
    got = prefill_attention.causal(q, k, v)
    assert got is not None and got.shape == (1, n, heads * 64)
    torch.testing.assert_close(got, _sdpa(q, k, v), atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("growth", [0.0, 0.3, 3.0])
def test_scores_that_keep_rising_or_spike_match_sdpa(growth: float) -> None:
    # A row's softmax shift moves only when a tile's scores rise more than 8 (log2 units)
    # above it: keys whose scores grow along the sequence (0.3: a few per tile; 3: a move at
    # every tile), one very large score in a late tile, and every score far below zero.
    q, k, v = _qkv(1, 300, 300, 6, 2, 64, seed=3)
    k = k * (1 + growth * torch.arange(300, dtype=torch.float32))[None, :, None, None]
    k[0, 250] *= 40
    low_q, low_k = q.clone(), k.clone()
    low_q[..., 0] -= 400  # and a common key component: every score near -4000 / sqrt(64)
    low_k[..., 0] += 10
    for qs, ks in ((q, k), (low_q, low_k)):
        got = prefill_attention.causal(qs, ks, v)
        assert got is not None and torch.isfinite(got).all()
        torch.testing.assert_close(got, _sdpa(qs, ks, v), atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize(("t", "s"), [(1, 1), (1, 130), (7, 70), (65, 130), (33, 200), (130, 131)])
@pytest.mark.parametrize("dim", [64, 128, 16])
def test_chunk_after_a_cached_prefix_matches_sdpa(t: int, s: int, dim: int) -> None:
    q, k, v = _qkv(2, t, s, 12, 3, dim, seed=t + s)
    got = prefill_attention.causal(q, k, v)
    assert got is not None
    torch.testing.assert_close(got, _sdpa(q, k, v), atol=1e-5, rtol=1e-5)


@needs_kernel
def test_strided_views_are_read_in_place() -> None:
    # K/V as the contiguous cache hands them over: the first S of T_max positions; q as a
    # column slice of a fused Q/K/V projection (rows (H+2G)*D apart).
    b, t_max, s, heads, groups, dim = 2, 160, 97, 8, 2, 64
    g = torch.Generator().manual_seed(5)
    cache_k = torch.randn(b, t_max, groups, dim, generator=g)
    cache_v = torch.randn(b, t_max, groups, dim, generator=g)
    qkv = torch.randn(b, 40, (heads + 2 * groups) * dim, generator=g)
    q = qkv[..., : heads * dim].unflatten(-1, (heads, dim))  # (B, 40, H, D), strided rows
    k, v = cache_k[:, :s], cache_v[:, :s]
    assert not q.is_contiguous() and not k.is_contiguous()
    got = prefill_attention.causal(q, k, v)
    assert got is not None
    torch.testing.assert_close(got, _sdpa(q.contiguous(), k.contiguous(), v.contiguous()),
                               atol=1e-5, rtol=1e-5)


@needs_kernel
def test_paged_chunks_match_the_gathered_sdpa() -> None:
    heads, groups, dim, pool, n_rows = 12, 4, 64, 400, 100
    g = torch.Generator().manual_seed(7)
    q = torch.randn(n_rows, heads, dim, generator=g)
    k_pool = torch.randn(pool, groups, dim, generator=g)
    v_pool = torch.randn(pool, groups, dim, generator=g)
    order = torch.randperm(pool, generator=g)
    # A whole 70-token prompt whose sampling row sits at the batch's tail, and a 9-token chunk
    # after a 31-token cached prefix; rows 79..98 belong to neither.
    chunks = [
        (torch.cat([torch.arange(10, 79), torch.tensor([99])]), order[:70]),
        (torch.arange(0, 9), order[200:240]),
    ]
    out = torch.full((n_rows, heads * dim), 7.0)
    packed = prefill_attention.PagedChunks.build(chunks)
    assert packed.valid()
    assert prefill_attention.causal_paged(q, k_pool, v_pool, packed, out)
    written = torch.zeros(n_rows, dtype=torch.bool)
    for rows, slots in chunks:
        ref = _sdpa(q[rows][None], k_pool[slots][None], v_pool[slots][None])[0]
        torch.testing.assert_close(out[rows], ref, atol=1e-5, rtol=1e-5)
        written[rows] = True
    assert bool((out[~written] == 7.0).all())  # only the chunks' rows are written


@needs_kernel
@pytest.mark.parametrize(("q_dtype", "pool_dtype"), [
    (torch.float32, torch.bfloat16), (torch.float32, torch.float8_e4m3fn),
    (torch.float32, torch.float8_e5m2), (torch.bfloat16, torch.float8_e4m3fn)])
def test_paged_chunks_read_a_narrower_pool_as_its_values_widened(
    q_dtype: torch.dtype, pool_dtype: torch.dtype
) -> None:
    # kv_cache_dtype: the kernel widens the pool's values as it packs its tiles, exactly, so
    # the result is the one over the pool widened to q's dtype up front, bit for bit.
    g = torch.Generator().manual_seed(9)
    q = torch.randn(60, 12, 64, generator=g).to(q_dtype)
    k_pool, v_pool = ((torch.randn(300, 4, 64, generator=g) * 2).to(pool_dtype)
                      for _ in range(2))
    order = torch.randperm(300, generator=g)
    chunks = prefill_attention.PagedChunks.build(
        [(torch.arange(0, 40), order[:40]), (torch.arange(45, 55), order[100:230])])
    got, want = (torch.zeros(60, 12 * 64, dtype=q_dtype) for _ in range(2))
    with prefill_attention.amx_switched(False):
        assert prefill_attention.causal_paged(q, k_pool, v_pool, chunks, got)
        assert prefill_attention.causal_paged(q, k_pool.to(q_dtype), v_pool.to(q_dtype),
                                              chunks, want)
    assert torch.equal(got, want)
    assert got[:40].abs().sum() > 0 and got[40:45].abs().sum() == 0


@needs_kernel
def test_fp32_is_as_close_to_float64_as_sdpa() -> None:
    # The softmax's exp2 is a polynomial fit (attention_tiles.h): in fp32 within 1.7e-7 of
    # 2^f, so the kernel stays as close to a float64 result as torch's own fp32 SDPA (a fit
    # to 7.5e-5, the bf16 path's, would put it ~100x further).
    q, k, v = _qkv(1, 300, 300, 12, 4, 64, seed=3)
    got = prefill_attention.causal(q, k, v)
    assert got is not None
    want = _sdpa(q.double(), k.double(), v.double())
    sdpa_err = (_sdpa(q, k, v).double() - want).abs().max().item()
    assert (got.double() - want).abs().max().item() <= 2 * sdpa_err


@needs_kernel
@pytest.mark.parametrize(("t", "s"), [(130, 130), (9, 70)])
def test_bf16_is_the_fp32_result_rounded_once(t: int, s: int) -> None:
    # bf16 in, widened to fp32 in the tiles (or multiplied exactly by VDPBF16PS), rounded once
    # on the way out: what SDPA gives in fp32 on the same bf16 values, to within that rounding
    # (and fp32 sums near zero). The AMX tiles round P too: next test.
    q, k, v = (x.bfloat16() for x in _qkv(2, t, s, 12, 4, 64, seed=11))
    with prefill_attention.bf16_switched(True), prefill_attention.amx_switched(False):
        got = prefill_attention.causal(q, k, v)
    assert got is not None and got.dtype == torch.bfloat16
    want = _sdpa(q.float(), k.float(), v.float())
    torch.testing.assert_close(got.float(), want, atol=1e-6, rtol=2**-8)
    assert (got.float() - want).abs().max() < (_sdpa(q, k, v).float() - want).abs().max() + 1e-6


@needs_kernel
def test_bf16_paged_chunks_match_the_gathered_fp32_sdpa() -> None:
    g = torch.Generator().manual_seed(8)
    q = torch.randn(50, 12, 64, generator=g).bfloat16()
    k_pool, v_pool = (torch.randn(300, 4, 64, generator=g).bfloat16() for _ in range(2))
    rows, slots = torch.arange(3, 43), torch.randperm(300, generator=g)[:60]
    out = torch.zeros(50, 12 * 64, dtype=torch.bfloat16)
    chunks = prefill_attention.PagedChunks.build([(rows, slots)])
    with prefill_attention.bf16_switched(True), prefill_attention.amx_switched(False):
        assert prefill_attention.causal_paged(q, k_pool, v_pool, chunks, out)
    want = _sdpa(q[rows][None].float(), k_pool[slots][None].float(), v_pool[slots][None].float())
    torch.testing.assert_close(out[rows].float(), want[0], atol=1e-6, rtol=2**-8)
    assert not prefill_attention.causal_paged(q, k_pool, v_pool, chunks, out.float())


@needs_kernel
def test_bf16_goes_to_sdpa_when_switched_off_and_fp32_stays() -> None:
    q, k, v = _qkv(1, 20, 20, 12, 4, 64)
    with prefill_attention.bf16_switched(False):
        assert prefill_attention.causal(q.bfloat16(), k.bfloat16(), v.bfloat16()) is None
        assert prefill_attention.causal(q, k, v) is not None
    with prefill_attention.bf16_switched(True):
        assert prefill_attention.causal(q.bfloat16(), k.bfloat16(), v.bfloat16()) is not None


needs_amx = pytest.mark.skipif(not prefill_attention.amx_tiles(),
                               reason="the kernel has no AMX tiles on this CPU")


def _error(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    e = (got.float() - want).abs()
    return float(e.max()), float(e.mean())


@needs_amx
@pytest.mark.parametrize(("t", "s", "heads", "groups", "dim"), [
    (130, 130, 12, 4, 64), (9, 70, 12, 4, 64), (17, 17, 4, 4, 64), (65, 200, 8, 2, 128),
    (40, 40, 6, 2, 96), (1, 1, 12, 4, 64), (300, 300, 12, 4, 64)])
def test_bf16_on_amx_tiles_is_as_close_as_torch_bf16_sdpa(t: int, s: int, heads: int,
                                                         groups: int, dim: int) -> None:
    """The tiles round P to bf16 for P V, as torch's bf16 flash kernel does: against SDPA in
    fp32 on the same bf16 values, the error is torch bf16 SDPA's own (mean within 10%)."""
    q, k, v = (x.bfloat16() for x in _qkv(2, t, s, heads, groups, dim, seed=5))
    with prefill_attention.bf16_switched(True):
        got = prefill_attention.causal(q, k, v)
    assert got is not None and got.dtype == torch.bfloat16
    want = _sdpa(q.float(), k.float(), v.float())
    ours, torchs = _error(got, want), _error(_sdpa(q, k, v), want)
    assert ours[0] <= torchs[0] + 2**-8 and ours[1] <= 1.1 * torchs[1] + 1e-6, (ours, torchs)


@needs_amx
def test_bf16_paged_chunks_on_amx_tiles_match_the_whole_prompt_path() -> None:
    g = torch.Generator().manual_seed(9)
    q = torch.randn(70, 12, 64, generator=g).bfloat16()
    k_pool, v_pool = (torch.randn(300, 4, 64, generator=g).bfloat16() for _ in range(2))
    chunks = [(torch.arange(0, 30), torch.randperm(300, generator=g)[:100]),
              (torch.arange(30, 70), torch.randperm(300, generator=g)[:40])]
    out = torch.zeros(70, 12 * 64, dtype=torch.bfloat16)
    with prefill_attention.bf16_switched(True):
        assert prefill_attention.causal_paged(
            q, k_pool, v_pool, prefill_attention.PagedChunks.build(chunks), out)
        for rows, slots in chunks:  # one chunk at a time, through the strided path: same tiles
            alone = prefill_attention.causal(q[rows][None], k_pool[slots][None],
                                             v_pool[slots][None])
            assert alone is not None and torch.equal(out[rows], alone[0])


@needs_amx
def test_amx_switched_nests_and_restores() -> None:
    q, k, v = (x.bfloat16() for x in _qkv(1, 40, 40, 12, 4, 64, seed=3))

    def run() -> torch.Tensor:
        with prefill_attention.bf16_switched(True):
            out = prefill_attention.causal(q, k, v)
        assert out is not None
        return out

    tiles = run()
    with prefill_attention.amx_switched(False):
        vdp = run()
        with prefill_attention.amx_switched(False):
            pass
        assert torch.equal(run(), vdp)  # still off after the inner block
    assert torch.equal(run(), tiles) and not torch.equal(tiles, vdp)


def test_bf16_takes_the_kernel_unless_the_cpu_has_amx_tiles_it_cannot_use() -> None:
    assert prefill_attention.takes_bf16() == (not amx.AMX_TILES or prefill_attention.amx_tiles())
    assert prefill_attention.takes_bf16(48) == (not amx.AMX_TILES)  # no multiple of 32
    with prefill_attention.bf16_switched(False):
        assert not prefill_attention.takes_bf16()


def test_paged_chunks_with_more_queries_than_keys_are_not_valid() -> None:
    bad = prefill_attention.PagedChunks.build([(torch.arange(5), torch.arange(4))])
    assert not bad.valid()


@needs_kernel
def test_falls_back_where_the_kernel_does_not_apply() -> None:
    q, k, v = _qkv(1, 8, 8, 4, 2, 64)
    assert prefill_attention.causal(q.half(), k.half(), v.half()) is None
    assert prefill_attention.causal(q.bfloat16(), k, v) is None  # mixed dtypes
    # the whole-prompt path takes q's dtype only (narrower pools are the paged path's)
    assert prefill_attention.causal(q, k.bfloat16(), v.bfloat16()) is None
    assert prefill_attention.causal(*_qkv(1, 8, 8, 4, 2, 24)) is None  # head_dim not 16k
    assert prefill_attention.causal(q[:, :, :, :32], k[..., :32], v[..., :32]) is None  # strided
    with torch.enable_grad():
        assert prefill_attention.causal(q.requires_grad_(), k, v) is None  # training: SDPA
    with prefill_attention.switched(False):
        assert prefill_attention.causal(q.detach(), k, v) is None


def _chunked_hidden(model: Transformer, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """Hidden states of every position, the prompt fed in chunks through the contiguous cache."""
    cache = model.new_cache(ids.shape[0], ids.shape[1])
    outs = []
    for i in range(0, ids.shape[1], chunk):
        part = ids[:, i : i + chunk]
        cache.begin(part.shape[1])
        outs.append(model.hidden_states(part, torch.arange(i, i + part.shape[1]), cache))
        cache.commit()
    return torch.cat(outs, 1)  # (B, T, d_model)


def _counting(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Counts the calls of prefill_attention.<name> that the kernel served."""
    real, served = getattr(prefill_attention, name), []

    def spy(*args: torch.Tensor) -> object:
        got = real(*args)
        served.extend([1] if got is not None and got is not False else [])
        return got

    monkeypatch.setattr(prefill_attention, name, spy)
    return served


@needs_kernel
@pytest.mark.parametrize("chunk", [70, 24])
def test_cached_prefill_matches_torch_sdpa(chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name("tiny")).eval()
    ids = torch.randint(0, model.cfg.vocab_size, (2, 70))
    served = _counting(monkeypatch, "causal")
    with torch.inference_mode():
        fast = _chunked_hidden(model, ids, chunk)
    assert len(served) == model.cfg.n_layers * -(-70 // chunk)  # every layer of every chunk
    with torch.inference_mode(), prefill_attention.switched(False):
        ref = _chunked_hidden(model, ids, chunk)
    torch.testing.assert_close(fast, ref, atol=1e-4, rtol=1e-4)


@needs_kernel
def test_uncached_forward_uses_the_kernel_only_without_autograd() -> None:
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name("tiny")).eval()
    ids = torch.randint(0, model.cfg.vocab_size, (2, 50))
    with torch.inference_mode():
        fast = model(ids)
        with prefill_attention.switched(False):
            ref = model(ids)
    torch.testing.assert_close(fast, ref, atol=1e-4, rtol=1e-4)
    trained = model(ids)  # autograd on: SDPA, which has a backward
    assert trained.requires_grad
    torch.testing.assert_close(trained.detach(), ref, atol=1e-4, rtol=1e-4)


@needs_kernel
def test_paged_engine_prefill_chunks_match_torch_sdpa(
    tiny_model: Transformer, tokenizer: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    from splitphase.engine.config import EngineConfig
    from splitphase.engine.llm_engine import LLMEngine
    from splitphase.engine.sampling_params import SamplingParams

    prompt = [0, *range(5, 45)]
    cfg = EngineConfig(num_blocks=64, max_num_batched_tokens=16, max_num_seqs=4)
    engine = LLMEngine(tiny_model, tokenizer, cfg)  # type: ignore[arg-type]
    served = _counting(monkeypatch, "causal_paged")
    with torch.inference_mode():
        rid = engine.add_request(prompt, SamplingParams(max_tokens=1), prompt_logprobs=0)
        out = None
        while engine.has_unfinished_requests():
            out = next((o for o in engine.step() if o.request_id == rid and o.finished), out)
        with prefill_attention.switched(False):
            ref = tiny_model(torch.tensor([prompt]))[0].log_softmax(-1)
    assert len(served) == tiny_model.cfg.n_layers * 3  # 41 tokens in chunks of 16
    assert out is not None and out.prompt_logprobs is not None
    expected = [float(ref[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
    assert [lp for lp, _ in out.prompt_logprobs] == pytest.approx(expected, abs=1e-4)
