"""kv_cache_dtype: the paged pool in a dtype other than the model's (bf16 or fp8 under fp32)."""

from __future__ import annotations

import pytest
import torch

from splitphase.audit.flops import step_cost
from splitphase.engine.config import KV_CACHE_DTYPE_BYTES, EngineConfig, kv_cache_dtype_bytes
from splitphase.engine.kv_cache import kv_cache_torch_dtype, write_pool_rows
from splitphase.engine.llm import LLM
from splitphase.engine.llm_engine import LLMEngine
from splitphase.engine.sampling_params import SamplingParams
from splitphase.errors import UserError
from splitphase.kernels import build, prefill_attention, skinny
from splitphase.model.tokenizer import Tokenizer
from splitphase.model.transformer import Transformer

PROMPTS = [[0, *range(5, 5 + n)] for n in (3, 17, 40)]


def _run(engine: LLMEngine, params: SamplingParams) -> list:
    ids = [engine.add_request(p, params) for p in PROMPTS]
    done = {}
    with torch.inference_mode():
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[i] for i in ids]


def test_an_unknown_dtype_is_refused() -> None:
    with pytest.raises(UserError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int4")


def test_the_torch_free_byte_table_matches_the_pools_dtypes() -> None:
    for name, nbytes in KV_CACHE_DTYPE_BYTES.items():  # what the audit and simulator price
        assert kv_cache_torch_dtype(name, torch.float32).itemsize == nbytes == \
            kv_cache_dtype_bytes(name, 4)
    assert kv_cache_dtype_bytes("auto", 2) == 2
    with pytest.raises(UserError, match="kv_cache_dtype must be one of"):
        kv_cache_dtype_bytes("int4", 2)


# kv_cache_dtype -> the pool's torch dtype ("fp8" is e4m3, as in vLLM).
NARROWER = {"bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn,
            "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _pool_dtype(kv_cache_dtype: str) -> torch.dtype:
    return NARROWER.get(kv_cache_dtype) or getattr(torch, kv_cache_dtype)


@pytest.mark.parametrize("kv_cache_dtype", list(NARROWER))
def test_a_narrower_pool_holds_more_blocks_of_the_same_budget(
    tiny_model: Transformer, tokenizer: Tokenizer, kv_cache_dtype: str
) -> None:
    budget = 1 << 20
    auto = LLMEngine(tiny_model, tokenizer, EngineConfig(kv_cache_bytes=budget))
    narrow = LLMEngine(tiny_model, tokenizer,
                       EngineConfig(kv_cache_bytes=budget, kv_cache_dtype=kv_cache_dtype))
    dtype = NARROWER[kv_cache_dtype]
    assert auto.cache.k.dtype == torch.float32
    assert narrow.cache.k.dtype == narrow.cache.v.dtype == dtype
    assert narrow.cache.num_blocks == 4 // dtype.itemsize * auto.cache.num_blocks
    assert narrow.cache.nbytes == auto.cache.nbytes <= budget


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "fp8"])
def test_steps_are_charged_the_pools_kv_bytes(
    tiny_model: Transformer, tokenizer: Tokenizer, kv_cache_dtype: str
) -> None:
    engine = LLMEngine(tiny_model, tokenizer,
                       EngineConfig(num_blocks=64, kv_cache_dtype=kv_cache_dtype))
    _run(engine, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    last = engine.steps[-1]  # a decode step of all three, each at its last position
    assert last.num_prefill_tokens == 0 and last.num_decode_seqs == 3
    positions = [len(p) + 1 for p in PROMPTS]
    kv_bytes = NARROWER[kv_cache_dtype].itemsize
    assert last.bytes == step_cost(tiny_model.cfg, [], positions, 4, kv_dtype_bytes=kv_bytes).bytes
    assert last.bytes < step_cost(tiny_model.cfg, [], positions, 4).bytes


def test_fp8_writes_saturate_and_round_trip_the_pools_values(
    tiny_model: Transformer, tokenizer: Tokenizer
) -> None:
    # A pool's writes go through a byte view (CPU index_copy_ has no fp8 kernel): the stored
    # values are torch's own cast, which saturates e4m3 at +-448 rather than making NaNs.
    engine = LLMEngine(tiny_model, tokenizer, EngineConfig(num_blocks=8, kv_cache_dtype="fp8"))
    pool = engine.cache.k[0]
    rows = torch.randn(3, *pool.shape[1:]) * 4
    rows[0, 0, :2] = torch.tensor([1000.0, -1e6])
    slots = torch.tensor([5, 0, 17])
    write_pool_rows(pool, slots, rows)
    got = pool[slots].float()
    assert torch.equal(got, rows.to(torch.float8_e4m3fn).float())
    assert got[0, 0, :2].tolist() == [448.0, -448.0]
    assert pool.view(torch.uint8)[1:5].eq(0).all()  # the slots between were not touched


# The most a greedy continuation's log-probability moves on the trained `small` model when its
# K/V are rounded to the pool's dtype (measured at most: bf16 0.006, fp8 e4m3 0.077, e5m2 0.13
# over 16 tokens of these prompts).
TRAINED_GAP = {"bfloat16": 0.05, "fp8": 0.25, "fp8_e5m2": 0.4}


@pytest.mark.parametrize("native", [True, False])
def test_narrower_pools_track_the_fp32_pool_on_a_trained_model(native: bool) -> None:
    # The embedded `small` model, trained: K/V rounded to bf16 (8 bits of mantissa) or fp8
    # (3 or 2) moves a greedy continuation's log-probabilities, not its tokens.
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
    prompts = ["In the beginning God created", "And the LORD spake unto Moses, saying"]
    runs = {}
    skinny.set_enabled(native)  # off: the torch paths (gather, widen, SDPA)
    try:
        for kvd in ("auto", *TRAINED_GAP):
            llm = LLM("small", kv_cache_dtype=kvd, num_blocks=32)
            runs[kvd] = llm.generate(prompts, [params] * 2)
    finally:
        skinny.set_enabled(True)
    worst = {}
    for kvd, bound in TRAINED_GAP.items():
        gaps = []
        for full, narrow in zip(runs["auto"], runs[kvd], strict=True):
            assert narrow.token_ids == full.token_ids, kvd
            gaps += [abs(a.logprob - b.logprob)
                     for a, b in zip(full.output.logprobs, narrow.output.logprobs, strict=True)]
        assert 0 < max(gaps) < bound, kvd  # > 0: the pool did round, the runs are not one
        worst[kvd] = max(gaps)
    assert worst["bfloat16"] < worst["fp8"] < worst["fp8_e5m2"]  # fewer mantissa bits, further


@pytest.mark.skipif(not build.available(), reason="native kernels unavailable")
@pytest.mark.parametrize(("kv_cache_dtype", "read_as"), [
    ("bfloat16", torch.bfloat16), ("fp8", torch.float8_e4m3fn), ("float16", torch.float32)])
def test_prefill_over_another_pool_runs_the_native_kernel(
    tiny_model: Transformer, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch,
    kv_cache_dtype: str, read_as: torch.dtype
) -> None:
    # bf16 and fp8 pools are read in place (widened as the kernel packs its tiles); an fp16
    # pool's chunk contexts are converted to the model's dtype first.
    took: list[tuple[torch.dtype, bool]] = []
    real = prefill_attention.causal_paged

    def spy(q: torch.Tensor, k: torch.Tensor, *args: object) -> bool:
        took.append((k.dtype, real(q, k, *args)))  # type: ignore[arg-type]
        return took[-1][1]

    monkeypatch.setattr(prefill_attention, "causal_paged", spy)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, logprobs=5)
    cfg = EngineConfig(num_blocks=64, kv_cache_dtype=kv_cache_dtype)
    native = _run(LLMEngine(tiny_model, tokenizer, cfg), params)
    assert took and all(t == (read_as, True) for t in took)
    with prefill_attention.switched(False):  # the torch path: gather, widen, SDPA
        reference = _run(LLMEngine(tiny_model, tokenizer, cfg), params)
    for a, b in zip(native, reference, strict=True):
        got, want = dict(a.logprobs[0].top_logprobs), dict(b.logprobs[0].top_logprobs)
        both = got.keys() & want.keys()
        assert len(both) >= 4 and a.token_ids == b.token_ids
        assert [got[t] for t in both] == pytest.approx([want[t] for t in both], abs=1e-4)


@pytest.mark.parametrize(("dtype", "kv_cache_dtype"), [
    ("bfloat16", "float32"), ("bfloat16", "float16"), ("float32", "float16"),
    ("bfloat16", "fp8"), ("bfloat16", "fp8_e5m2")])
def test_other_model_and_pool_pairs_generate_as_the_models_own_pool(
    dtype: str, kv_cache_dtype: str
) -> None:
    # fp16 pools take the torch paths (gather and widen); a wider pool than the model narrows
    # when read; fp8 under a bf16 model goes through the native kernels (prefill's packs its
    # tiles from the fp8 pool: bf16 queries over narrower keys).
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompt = ["In the beginning God created"]
    texts = []
    for kvd in ("auto", kv_cache_dtype):
        llm = LLM("small", dtype=dtype, kv_cache_dtype=kvd, num_blocks=32)
        texts.append(llm.generate(prompt, params)[0].text)
    assert llm.engine.cache.k.dtype == _pool_dtype(kv_cache_dtype)
    assert texts[1] == texts[0]


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "fp8"])
@pytest.mark.parametrize("arch", ["dual_flow", "moe"])
def test_dual_flow_and_moe_decode_over_a_narrower_pool(
    tokenizer: Tokenizer, arch: str, kv_cache_dtype: str
) -> None:
    # Their decode takes other paths than the fused pass: the auxiliary flow's read-only
    # attention over the pool, the MoE per-op layers.
    from splitphase.model.config import ModelConfig
    from splitphase.model.dual_flow import DualFlowTransformer

    torch.manual_seed(1)
    if arch == "dual_flow":
        cfg = ModelConfig.from_name("tiny").with_(vocab_size=tokenizer.vocab_size, arch=arch)
        model: Transformer = DualFlowTransformer(cfg).eval()
        with torch.no_grad():  # non-zero couplings: the auxiliary flow changes the output
            for p in model.couplings.parameters():
                p.normal_(0, 0.5)
    else:
        model = Transformer(ModelConfig.from_name("tiny-moe").with_(
            vocab_size=tokenizer.vocab_size)).eval()
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=5)
    runs = [_run(LLMEngine(model, tokenizer, EngineConfig(num_blocks=64, kv_cache_dtype=d)),
                 params) for d in ("auto", kv_cache_dtype)]
    compared = 0
    for full, half in zip(*runs, strict=True):
        assert len(half.token_ids) == 6
        for x, y in zip(full.logprobs, half.logprobs, strict=True):  # while the tokens agree
            a, b = dict(x.top_logprobs), dict(y.top_logprobs)
            both = a.keys() & b.keys()
            assert len(both) >= 3
            assert [a[t] for t in both] == pytest.approx([b[t] for t in both], abs=0.02)
            compared += 1
            if x.token_id != y.token_id:
                break
    assert compared >= 2 * len(PROMPTS)  # decode steps too, not only the prompts' last rows


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("kv_cache_dtype", "tol"), [("float16", 0.05), ("float32", 0.05),
                                                     ("fp8", TRAINED_GAP["fp8"])])
def test_on_cuda_a_bf16_model_over_another_pool_tracks_its_own(
    kv_cache_dtype: str, tol: float
) -> None:
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
    prompt = ["In the beginning God created"]
    runs = {}
    for kvd in ("auto", kv_cache_dtype):
        llm = LLM("small", device="cuda", dtype="bfloat16", kv_cache_dtype=kvd, num_blocks=32)
        assert llm.engine.cache.k.device.type == "cuda"
        runs[kvd] = llm.generate(prompt, params)[0]
    assert llm.engine.cache.k.dtype == _pool_dtype(kv_cache_dtype)
    full, other = runs["auto"], runs[kv_cache_dtype]
    assert other.token_ids[:4] == full.token_ids[:4]
    first = (full.output.logprobs[0].logprob, other.output.logprobs[0].logprob)
    assert first[0] == pytest.approx(first[1], abs=tol)
