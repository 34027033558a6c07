"""kv_cache_dtype: the paged pool in a dtype other than the model's (bf16 under fp32)."""

from __future__ import annotations

import pytest
import torch

from splitphase.audit.flops import step_cost
from splitphase.engine.config import EngineConfig
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
        EngineConfig(kv_cache_dtype="fp8")


def test_a_bf16_pool_holds_twice_the_blocks_of_the_same_budget(
    tiny_model: Transformer, tokenizer: Tokenizer
) -> None:
    budget = 1 << 20
    auto = LLMEngine(tiny_model, tokenizer, EngineConfig(kv_cache_bytes=budget))
    half = LLMEngine(tiny_model, tokenizer,
                     EngineConfig(kv_cache_bytes=budget, kv_cache_dtype="bfloat16"))
    assert auto.cache.k.dtype == torch.float32 and half.cache.k.dtype == torch.bfloat16
    assert half.cache.v.dtype == torch.bfloat16
    assert half.cache.num_blocks == 2 * auto.cache.num_blocks
    assert half.cache.nbytes == auto.cache.nbytes <= budget


def test_steps_are_charged_the_pools_kv_bytes(
    tiny_model: Transformer, tokenizer: Tokenizer
) -> None:
    engine = LLMEngine(tiny_model, tokenizer,
                       EngineConfig(num_blocks=64, kv_cache_dtype="bfloat16"))
    _run(engine, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    last = engine.steps[-1]  # a decode step of all three, each at its last position
    assert last.num_prefill_tokens == 0 and last.num_decode_seqs == 3
    positions = [len(p) + 1 for p in PROMPTS]
    assert last.bytes == step_cost(tiny_model.cfg, [], positions, 4, kv_dtype_bytes=2).bytes
    assert last.bytes < step_cost(tiny_model.cfg, [], positions, 4).bytes


@pytest.mark.parametrize("native", [True, False])
def test_bf16_pool_tracks_the_fp32_pool_on_a_trained_model(native: bool) -> None:
    # The embedded `small` model, trained: K/V rounded to bf16 (8 bits of mantissa) moves
    # a greedy continuation's log-probabilities by a few thousandths, not its tokens.
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
    prompts = ["In the beginning God created", "And the LORD spake unto Moses, saying"]
    runs = {}
    skinny.set_enabled(native)  # off: the torch paths (gather, widen, SDPA)
    try:
        for kvd in ("auto", "bfloat16"):
            llm = LLM("small", kv_cache_dtype=kvd, num_blocks=32)
            runs[kvd] = llm.generate(prompts, [params] * 2)
    finally:
        skinny.set_enabled(True)
    gaps = []
    for full, half in zip(runs["auto"], runs["bfloat16"], strict=True):
        assert half.token_ids == full.token_ids
        gaps += [abs(a.logprob - b.logprob)
                 for a, b in zip(full.output.logprobs, half.output.logprobs, strict=True)]
    assert max(gaps) < 0.05  # 0.004 at most here
    assert max(gaps) > 0  # the pool did round: the two runs are not one


@pytest.mark.skipif(not build.available(), reason="native kernels unavailable")
def test_prefill_over_a_bf16_pool_runs_the_native_kernel_on_widened_contexts(
    tiny_model: Transformer, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    took: list[tuple[torch.dtype, bool]] = []
    real = prefill_attention.causal_paged

    def spy(q: torch.Tensor, k: torch.Tensor, *args: object) -> bool:
        took.append((k.dtype, real(q, k, *args)))  # type: ignore[arg-type]
        return took[-1][1]

    monkeypatch.setattr(prefill_attention, "causal_paged", spy)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, logprobs=5)
    cfg = EngineConfig(num_blocks=64, kv_cache_dtype="bfloat16")
    native = _run(LLMEngine(tiny_model, tokenizer, cfg), params)
    assert took and all(t == (torch.float32, True) for t in took)  # widened, then native
    with prefill_attention.switched(False):  # the torch path: gather, widen, SDPA
        reference = _run(LLMEngine(tiny_model, tokenizer, cfg), params)
    for a, b in zip(native, reference, strict=True):
        got, want = dict(a.logprobs[0].top_logprobs), dict(b.logprobs[0].top_logprobs)
        both = got.keys() & want.keys()
        assert len(both) >= 4 and a.token_ids == b.token_ids
        assert [got[t] for t in both] == pytest.approx([want[t] for t in both], abs=1e-4)


@pytest.mark.parametrize(("dtype", "kv_cache_dtype"), [
    ("bfloat16", "float32"), ("bfloat16", "float16"), ("float32", "float16")])
def test_other_model_and_pool_pairs_generate_as_the_models_own_pool(
    dtype: str, kv_cache_dtype: str
) -> None:
    # fp16 pools take the torch paths (gather and widen); a wider pool than the model narrows
    # when read.
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompt = ["In the beginning God created"]
    texts = []
    for kvd in ("auto", kv_cache_dtype):
        llm = LLM("small", dtype=dtype, kv_cache_dtype=kvd, num_blocks=32)
        texts.append(llm.generate(prompt, params)[0].text)
    assert llm.engine.cache.k.dtype == getattr(torch, kv_cache_dtype)
    assert texts[1] == texts[0]


@pytest.mark.parametrize("arch", ["dual_flow", "moe"])
def test_dual_flow_and_moe_decode_over_a_bf16_pool(tokenizer: Tokenizer, arch: str) -> None:
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
                 params) for d in ("auto", "bfloat16")]
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
@pytest.mark.parametrize("kv_cache_dtype", ["float16", "float32"])
def test_on_cuda_a_bf16_model_over_another_pool_tracks_its_own(kv_cache_dtype: str) -> None:
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
    prompt = ["In the beginning God created"]
    runs = {}
    for kvd in ("auto", kv_cache_dtype):
        llm = LLM("small", device="cuda", dtype="bfloat16", kv_cache_dtype=kvd, num_blocks=32)
        assert llm.engine.cache.k.device.type == "cuda"
        runs[kvd] = llm.generate(prompt, params)[0]
    assert llm.engine.cache.k.dtype == getattr(torch, kv_cache_dtype)
    full, other = runs["auto"], runs[kv_cache_dtype]
    assert other.token_ids[:4] == full.token_ids[:4]
    first = (full.output.logprobs[0].logprob, other.output.logprobs[0].logprob)
    assert first[0] == pytest.approx(first[1], abs=0.05)
