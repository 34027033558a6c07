"""The paged engine's greedy tokens equal the reference model's `generate`."""

import copy
import itertools

import pytest
import torch

from splitphase.engine.config import EngineConfig
from splitphase.engine.llm import LLM
from splitphase.engine.llm_engine import LLMEngine
from splitphase.engine.sampling_params import SamplingParams
from splitphase.errors import UserError
from splitphase.kernels import build, packed_linear
from splitphase.model import compiled

PROMPTS = [[0, *range(5, 5 + n)] for n in (3, 17, 40, 9, 33)]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _run(engine: LLMEngine, prompts, params=GREEDY):
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.inference_mode():
        yield


@pytest.fixture(scope="module")
def reference(tiny_model):
    return [tiny_model.generate(p, 12) for p in PROMPTS]


@pytest.mark.slow
def test_compiled_engine_matches_reference(inductor, tiny_model, tokenizer, reference):
    cfg = EngineConfig(policy="chunked", num_blocks=200, max_num_batched_tokens=64,
                       max_num_seqs=8, compile=["prefill", "decode"])
    with compiled.switched(False):  # the engine turns compile on process-wide; undone after
        engine = LLMEngine(tiny_model, tokenizer, cfg)
        assert compiled.enabled_phases() == ["prefill", "decode"]
        outs = _run(engine, PROMPTS)
    assert [o.token_ids for o in outs] == reference
    assert compiled.enabled_phases() == []


def test_compile_phases_are_checked():
    with pytest.raises(UserError, match="compile phases"):
        EngineConfig(compile=("train",))


@pytest.mark.parametrize("policy", ["mixed", "chunked"])
@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("num_blocks", [200, 6])  # 6 blocks forces preemption by recompute
def test_greedy_matches_reference(
    tiny_model, tokenizer, reference, policy, prefix_caching, num_blocks
):
    cfg = EngineConfig(
        policy=policy,
        num_blocks=num_blocks,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        enable_prefix_caching=prefix_caching,
    )
    engine = LLMEngine(tiny_model, tokenizer, cfg)
    outs = _run(engine, PROMPTS)
    assert [o.token_ids for o in outs] == reference
    assert all(o.finish_reason == "length" for o in outs)
    if num_blocks == 6:
        assert any(o.request.num_preemptions > 0 for o in outs)
    # The steps carry what the server counts as it happens: each preemption once, and each
    # admission's lookup (a preempted request's again) where the engine caches prefixes.
    steps = engine.steps
    assert sum(s.num_preemptions for s in steps) == sum(o.request.num_preemptions for o in outs)
    queries = sum(s.prefix_cache_queries_tokens for s in steps)
    assert queries >= sum(map(len, PROMPTS)) if prefix_caching else queries == 0
    assert engine.scheduler.block_manager.num_used_blocks == 0
    engine.scheduler.block_manager.check_invariants()


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_any_block_size_matches_reference(tiny_model, tokenizer, reference, block_size):
    # The paged kernels read the block size from the pool: blocks of one token, or ones a
    # prompt only partly fills, give the same tokens as the default 16.
    cfg = EngineConfig(policy="chunked", block_size=block_size, num_blocks=3200 // block_size,
                       max_num_batched_tokens=64, max_num_seqs=8)
    engine = LLMEngine(tiny_model, tokenizer, cfg)
    assert [o.token_ids for o in _run(engine, PROMPTS)] == reference
    assert engine.cache.block_size == block_size
    engine.scheduler.block_manager.check_invariants()


def test_shared_prefix_reuses_blocks_and_matches(tiny_model, tokenizer):
    prefix = list(range(10, 50))  # 40 tokens: two full blocks of 16 are shareable
    prompts = [[0, *prefix, 7], [0, *prefix, 8, 9]]
    engine = LLMEngine(tiny_model, tokenizer, EngineConfig(num_blocks=64))
    first = _run(engine, prompts[:1])
    second = _run(engine, prompts[1:])
    assert second[0].request.num_cached_tokens == 32
    assert sum(s.prefix_cache_queries_tokens for s in engine.steps) == 42 + 43
    assert sum(s.prefix_cache_hits_tokens for s in engine.steps) == 32
    assert first[0].token_ids == tiny_model.generate(prompts[0], 12)
    assert second[0].token_ids == tiny_model.generate(prompts[1], 12)


def test_steps_are_tagged_with_phase_and_cost(tiny_model, tokenizer):
    engine = LLMEngine(
        tiny_model,
        tokenizer,
        EngineConfig(policy="mixed", num_blocks=64, max_num_batched_tokens=256),
    )
    _run(engine, PROMPTS[:2])
    phases = [s.phase for s in engine.steps]
    assert phases[0] == "prefill" and phases[-1] == "decode"
    assert all(s.flops > 0 and s.bytes > 0 and s.wall_s > 0 for s in engine.steps)
    assert sum(s.num_prefill_tokens for s in engine.steps) == sum(len(p) for p in PROMPTS[:2])
    # Each step starts after the previous one ended: start + wall gives the loop's cadence.
    for a, b in itertools.pairwise(engine.steps):
        assert b.started_s >= a.started_s + a.wall_s > 0


def test_seeded_sampling_independent_of_batch(tiny_model, tokenizer):
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=42, ignore_eos=True)
    alone = LLM(tiny_model, tokenizer, num_blocks=64).generate([PROMPTS[1]], params)
    other = SamplingParams(max_tokens=7, temperature=0.7, seed=3, ignore_eos=True)
    batched = LLM(tiny_model, tokenizer, num_blocks=64).generate(
        [PROMPTS[0], PROMPTS[1], PROMPTS[2]], [other, params, other]
    )
    assert batched[1].token_ids == alone[0].token_ids


def test_n_samples_share_prompt_and_differ(tiny_model, tokenizer):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=5, n=3, ignore_eos=True)
    llm = LLM(tiny_model, tokenizer, num_blocks=64)
    outs = llm.generate([PROMPTS[2]], params)
    assert len(outs) == 3 and len({tuple(o.token_ids) for o in outs}) > 1
    assert llm.engine.scheduler.block_manager.num_used_blocks == 0


def test_logprobs_match_reference_log_softmax(tiny_model, tokenizer):
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=3, ignore_eos=True)
    out = LLM(tiny_model, tokenizer, num_blocks=64).generate([PROMPTS[0]], params)[0].output
    seq = list(PROMPTS[0])
    for tok in out.logprobs:
        ref = tiny_model(torch.tensor([seq]))[0, -1].log_softmax(-1)
        assert tok.logprob == pytest.approx(float(ref[tok.token_id]), abs=1e-4)
        assert [t for t, _ in tok.top_logprobs] == ref.topk(3).indices.tolist()
        seq.append(tok.token_id)


def test_prompt_logprobs(tiny_model, tokenizer):
    engine = LLMEngine(
        tiny_model,
        tokenizer,
        EngineConfig(num_blocks=64, max_num_batched_tokens=16, max_num_seqs=4),
    )
    rid = engine.add_request(
        PROMPTS[2], SamplingParams(max_tokens=1, temperature=0), prompt_logprobs=0
    )
    out = None
    while engine.has_unfinished_requests():
        out = next((o for o in engine.step() if o.request_id == rid and o.finished), out)
    assert out is not None and out.prompt_logprobs is not None
    ref = tiny_model(torch.tensor([PROMPTS[2]]))[0].log_softmax(-1)
    expected = [float(ref[i, PROMPTS[2][i + 1]]) for i in range(len(PROMPTS[2]) - 1)]
    assert [lp for lp, _ in out.prompt_logprobs] == pytest.approx(expected, abs=1e-4)


def test_stop_string_across_tokens_not_in_output(tiny_model, tokenizer):
    base = LLM(tiny_model, tokenizer, num_blocks=64).generate(
        [PROMPTS[3]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    )[0]
    text = base.text
    stop = text[3:7]  # a stop string that very likely spans a token boundary
    out = LLM(tiny_model, tokenizer, num_blocks=64).generate(
        [PROMPTS[3]], SamplingParams(max_tokens=12, temperature=0, stop=[stop], ignore_eos=True)
    )[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index(stop)]


def test_abort_mid_decode_frees_blocks(tiny_model, tokenizer):
    engine = LLMEngine(tiny_model, tokenizer, EngineConfig(num_blocks=64))
    rid = engine.add_request(PROMPTS[4], SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine.scheduler.block_manager.num_used_blocks > 0
    engine.abort_request(rid)
    outs = engine.step()
    assert [o.finish_reason for o in outs if o.request_id == rid] == ["abort"]
    assert engine.scheduler.block_manager.num_used_blocks == 0
    assert not engine.has_unfinished_requests()


def test_construction_warms_up_kernels_and_packed_weights(tiny_model, tokenizer):
    """Loading the kernels and packing the prefill GEMMs' weights is the engine's start-up
    cost, not the first request's TTFT."""
    with torch.inference_mode(False):  # weights with version counters, which packing keys on
        model = copy.deepcopy(tiny_model)  # fresh, empty packed copies
    attn = model.layers[0].self_attn
    assert attn.qkv_packed.nbytes == 0
    with packed_linear.switched(True):
        LLMEngine(model, tokenizer, EngineConfig(num_blocks=64))
    assert build.status().loaded or build.status().reason != "not built yet"
    if packed_linear.available():
        assert attn.qkv_packed.nbytes > 0 and model.layers[-1].mlp.down_proj.packed.nbytes > 0
    # Weights made under inference_mode cannot be packed (no version counter): torch's linear.
    inference_copy = copy.deepcopy(tiny_model)
    assert inference_copy.layers[0].self_attn.q_proj.weight.is_inference()
    engine = LLMEngine(inference_copy, tokenizer, EngineConfig(num_blocks=64))
    assert inference_copy.layers[0].self_attn.qkv_packed.nbytes == 0
    engine.add_request(list(range(1, 40)), SamplingParams(max_tokens=2, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()


def test_prompt_over_context_is_a_clear_error(tiny_model, tokenizer):
    engine = LLMEngine(tiny_model, tokenizer, EngineConfig(num_blocks=64))
    with pytest.raises(UserError, match="exceeds the context length"):
        engine.add_request([1] * 250, SamplingParams(max_tokens=10))
    with pytest.raises(UserError, match="outside the vocabulary"):
        engine.add_request([10**6], SamplingParams(max_tokens=1))
    # Refused at admission: in the sampler it would fail the step for every request in it.
    with pytest.raises(UserError, match="logit_bias has token ids .10000000. outside"):
        engine.add_request([1, 2], SamplingParams(max_tokens=1, logit_bias={10**7: 5.0}))
    assert not engine.has_unfinished_requests()


def test_max_model_len_caps_requests_and_is_refused_past_the_engine(tiny_model, tokenizer):
    engine = LLMEngine(tiny_model, tokenizer, EngineConfig(num_blocks=64, max_model_len=100))
    assert engine.max_model_len == 100  # the model allows 256, the pool 1,024
    with pytest.raises(UserError, match="exceeds the context length"):
        engine.add_request([1] * 95, SamplingParams(max_tokens=10))
    engine.add_request([1] * 90, SamplingParams(max_tokens=10))
    for config, fragment in (
        (EngineConfig(num_blocks=64, max_model_len=300), "the model's max_seq_len, 256: lower"),
        (EngineConfig(num_blocks=8, max_model_len=200), "the K/V pool's tokens, 128: lower it, "
                                                        "or grow the pool"),
        (EngineConfig(policy="mixed", num_blocks=64, max_num_batched_tokens=64,
                      max_model_len=200), "max_num_batched_tokens"),
    ):
        with pytest.raises(UserError, match=fragment):
            LLMEngine(tiny_model, tokenizer, config)
    with pytest.raises(UserError, match="max_model_len must be >= 1"):
        EngineConfig(max_model_len=0)
    # The default pool holds max_num_seqs sequences of max_model_len, not of max_seq_len.
    capped = LLMEngine(tiny_model, tokenizer, EngineConfig(max_num_seqs=8, max_model_len=64))
    whole = LLMEngine(tiny_model, tokenizer, EngineConfig(max_num_seqs=8))
    assert (capped.kv_pool_blocks, whole.kv_pool_blocks) == (8 * 4, 8 * 256 // 16)


@pytest.fixture(scope="module")
def dual_flow_model(tokenizer):
    from splitphase.model.config import ModelConfig
    from splitphase.model.dual_flow import DualFlowTransformer

    torch.manual_seed(1)
    cfg = ModelConfig.from_name("tiny").with_(vocab_size=tokenizer.vocab_size, arch="dual_flow")
    model = DualFlowTransformer(cfg).eval()
    with torch.no_grad():  # non-zero couplings, so the auxiliary flow really changes P
        for p in model.couplings.parameters():
            p.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("policy", ["mixed", "chunked"])
@pytest.mark.parametrize("num_blocks", [200, 6])
def test_dual_flow_engine_matches_reference(dual_flow_model, tokenizer, policy, num_blocks):
    reference = [dual_flow_model.generate(p, 12) for p in PROMPTS]
    engine = LLMEngine(
        dual_flow_model,
        tokenizer,
        EngineConfig(
            policy=policy, num_blocks=num_blocks, max_num_batched_tokens=64, max_num_seqs=8
        ),
    )
    assert [o.token_ids for o in _run(engine, PROMPTS)] == reference
    # The auxiliary flow allocates nothing: the KV pool is the baseline's geometry.
    assert engine.cache.k.shape[0] == dual_flow_model.cfg.n_layers
    assert engine.scheduler.block_manager.num_used_blocks == 0


def test_dual_flow_engine_logprobs_are_the_mixture(dual_flow_model, tokenizer):
    params = SamplingParams(max_tokens=3, temperature=0, logprobs=1, ignore_eos=True)
    out = LLM(dual_flow_model, tokenizer, num_blocks=64).generate([PROMPTS[1]], params)[0].output
    seq = list(PROMPTS[1])
    for tok in out.logprobs:
        ref = dual_flow_model(torch.tensor([seq]))[0, -1]  # teacher-forced log P
        assert tok.logprob == pytest.approx(float(ref[tok.token_id]), abs=1e-4)
        seq.append(tok.token_id)


def test_prompt_logprobs_complete_even_when_the_prefix_is_cached(tiny_model, tokenizer):
    engine = LLMEngine(tiny_model, tokenizer, EngineConfig(num_blocks=64))
    params = SamplingParams(max_tokens=1, temperature=0)
    firsts = []
    for rid in ("a", "b"):  # the second request's prompt is fully cached by the first
        engine.add_request(PROMPTS[2], params, request_id=rid, prompt_logprobs=0)
        while engine.has_unfinished_requests():
            firsts += [o for o in engine.step() if o.finished]
    a, b = firsts
    assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(PROMPTS[2]) - 1
    assert a.prompt_logprobs == b.prompt_logprobs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("policy", ["mixed", "chunked"])
@pytest.mark.parametrize("num_blocks", [200, 6])
def test_engine_on_cuda_matches_reference(tiny_model, tokenizer, reference, policy, num_blocks):
    """The paged cache, its slot writes and the batched steps on the GPU: the CPU's tokens."""
    model = copy.deepcopy(tiny_model).to("cuda")
    cfg = EngineConfig(policy=policy, num_blocks=num_blocks, max_num_batched_tokens=64,
                       max_num_seqs=8)
    engine = LLMEngine(model, tokenizer, cfg)
    assert engine.runner.cache.k.device.type == "cuda"
    outs = _run(engine, PROMPTS)
    assert [o.token_ids for o in outs] == reference
    assert engine.scheduler.block_manager.num_used_blocks == 0
