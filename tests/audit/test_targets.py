"""Audit targets: builtin on a tiny random model, openai against a fake server, hf on tiny llama."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch

from splitphase.audit.fake_server import FakeOpenAIServer, FakeTiming
from splitphase.audit.probes import (
    ProbePlan,
    PromptMaker,
    interference_requests,
    load_workload,
    plan_for,
    run_probe,
)
from splitphase.audit.steps import profile
from splitphase.audit.targets import open_target, prometheus
from splitphase.audit.targets.builtin import BuiltinTarget
from splitphase.audit.trace import ProbeRequest, RequestTrace
from splitphase.errors import UserError
from splitphase.model.checkpoint import save_checkpoint
from splitphase.model.config import ModelConfig
from splitphase.model.tokenizer import Tokenizer
from splitphase.model.transformer import Transformer

TINY = ModelConfig.from_name("tiny").with_(vocab_size=4096)  # the shipped tokenizer's 4096 ids


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    return save_checkpoint(Transformer(TINY), tmp_path_factory.mktemp("tiny"))


def _requests(target, n: int, count: int, out: int, conc: int) -> list[ProbeRequest]:
    maker = PromptMaker(target.codec())
    reqs = []
    for _ in range(count):
        ids, text = maker.make(n)
        reqs.append(ProbeRequest(ids, text, out, f"len={n} c={conc}", conc))
    return reqs


def _check_timeline(t: RequestTrace, out: int) -> None:
    assert t.ok and t.output_tokens == out and len(t.token_times_s) == out
    assert t.send_s < t.first_token_s == t.token_times_s[0]
    assert t.token_times_s == sorted(t.token_times_s) and t.end_s >= t.token_times_s[-1]


def test_prompts_have_exact_lengths_and_differ() -> None:
    maker = PromptMaker(_codec())
    (a, text_a), (b, _) = maker.make(40), maker.make(40)
    assert len(a) == len(b) == 40 and a != b  # unique prompts defeat prefix caching
    assert _codec().encode(text_a)[:3] == list(a[:3])


def _codec():
    from splitphase.audit.targets.base import TokenizerCodec

    return TokenizerCodec(Tokenizer.default())


def test_builtin_batches_equal_lengths(tiny_ckpt: Path) -> None:
    target = open_target(f"builtin:{tiny_ckpt}")
    assert target.model_config() == TINY
    assert target.describe()["kind"] == "builtin"
    traces = target.run(_requests(target, 24, 4, 5, 2), concurrency=2)
    assert len(traces) == 4
    for t in traces:
        _check_timeline(t, 5)
        assert t.prompt_tokens == 24 and t.concurrency == 2
    # Batches of two share one timeline; the second batch starts after the first ends.
    assert traces[0].token_times_s == traces[1].token_times_s
    assert traces[2].send_s >= traces[1].end_s


def test_builtin_runner_is_pluggable(tiny_ckpt: Path) -> None:
    calls = []

    def runner(prompt_ids: list[list[int]], max_tokens: int) -> list[RequestTrace]:
        calls.append((len(prompt_ids), max_tokens))
        times = [1.0 + 0.1 * i for i in range(max_tokens)]
        return [RequestTrace(len(p), max_tokens, 0.5, 1.0, times, times[-1]) for p in prompt_ids]

    target = BuiltinTarget(str(tiny_ckpt), runner=runner)
    target.run(_requests(target, 8, 3, 4, 2), concurrency=2)
    assert calls == [(2, 4), (1, 4)]


def test_builtin_rejects_a_tokenizer_larger_than_the_vocab(tmp_path: Path) -> None:
    save_checkpoint(Transformer(ModelConfig.from_name("tiny")), tmp_path)  # vocab 512
    with pytest.raises(UserError, match="tokenizer has 4096 ids"):
        open_target(f"builtin:{tmp_path}")


def test_openai_streams_and_scrapes_metrics() -> None:
    timing = FakeTiming(prefill_base_s=0.004, prefill_s_per_token=1e-4, itl_s=0.003)
    with FakeOpenAIServer(timing) as url:
        target = open_target(f"openai:{url}/v1/", ModelConfig.from_name("llama-3.2-1b"))
        info = target.describe()
        assert info["model"] == "fake-model" and info["server_metrics"] is True
        traces = target.run(_requests(target, 64, 4, 6, 4), concurrency=4)
        target.close()
    for t in traces:
        _check_timeline(t, 6)
        assert t.prompt_tokens > 0  # the server's count, from usage
        assert t.server_prefill_s == pytest.approx(0.004 + 1e-4 * t.prompt_tokens, rel=0.3)
        assert t.server_queue_s is not None and t.server_itl_s is not None
    prof = profile(traces)
    assert prof.source == "server"
    assert prof.itl.p50_s == pytest.approx(0.003, abs=0.003)


def test_openai_without_metrics_uses_client_times() -> None:
    with FakeOpenAIServer(FakeTiming(metrics=False)) as url:
        target = open_target(f"openai:{url}", ModelConfig.from_name("tiny"))
        assert target.describe()["server_metrics"] is False
        traces = target.run(_requests(target, 16, 1, 3, 1), 1)
    assert traces[0].server_prefill_s is None and profile(traces).source == "client"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_openai_user_errors() -> None:
    with pytest.raises(UserError, match="cannot reach"):
        open_target(f"openai:http://127.0.0.1:{_free_port()}")
    with FakeOpenAIServer(FakeTiming(openai=False)) as url, pytest.raises(
        UserError, match="not an OpenAI-compatible server"
    ):
        open_target(f"openai:{url}")
    with FakeOpenAIServer() as url:
        target = open_target(f"openai:{url}")  # geometry is only needed for the steps
        with pytest.raises(UserError, match="serves 'fake-model', and no preset.*--model-config"):
            target.model_config()
    with pytest.raises(UserError, match="unknown target"):
        open_target("grpc:somewhere")


def test_openai_geometry_from_the_served_model_id() -> None:
    # A vLLM user points at the endpoint: the id it serves names the preset, and the report
    # says where the geometry came from; --model-config still wins.
    served = "meta-llama/Llama-3.1-8B-Instruct"
    with FakeOpenAIServer(FakeTiming(model_id=served)) as url:
        target = open_target(f"openai:{url}")
        assert target.model_config() == ModelConfig.from_name("llama-3.1-8b")
        source = target.describe()["model_config_source"]
        assert source == f"served model id {served!r}"
        given = open_target(f"openai:{url}", ModelConfig.from_name("tiny"))
        assert given.model_config().name == "tiny"
        assert given.describe()["model_config_source"] == "--model-config"


def test_openai_geometry_from_a_served_directory_here(tmp_path: Path) -> None:
    # A directory on this machine is read; one whose config.json we cannot use still names
    # its preset by its name.
    bad = tmp_path / "Llama-3.2-1B"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    with FakeOpenAIServer(FakeTiming(model_id=str(bad))) as url:
        target = open_target(f"openai:{url}")
        assert target.model_config() == ModelConfig.from_name("llama-3.2-1b")
        assert target.describe()["model_config_source"] == f"served model id {str(bad)!r}"
        assert target.describe()["quantization"] is None
    # The directory's quantization_config states the weights' format, over its name's words.
    fp8 = tmp_path / "llama-awq"
    fp8.mkdir()
    (fp8 / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "fp8"}}))
    with FakeOpenAIServer(FakeTiming(model_id=str(fp8))) as url:
        assert open_target(f"openai:{url}").describe()["quantization"] == "fp8"


@pytest.mark.parametrize("base_s", [0.001, 0.15], ids=["short-ttft", "ttft-dwarfs-itl"])
@pytest.mark.parametrize("mixed, stalls", [(True, True), (False, False)])
def test_interference_probe_tells_mixed_from_isolated(mixed: bool, stalls: bool,
                                                      base_s: float) -> None:
    timing = FakeTiming(prefill_base_s=base_s, prefill_s_per_token=2e-4, itl_s=0.004,
                        mixed=mixed)
    plan = ProbePlan(prompt_lens=(16, 400), concurrency_levels=(1, 2), output_tokens=4,
                     decode_prompt_len=16, repeats=1)
    with FakeOpenAIServer(timing) as url:
        target = open_target(f"openai:{url}", ModelConfig.from_name("tiny"))
        result = run_probe(target, plan, 2048, progress=False)
    inter = profile(result.traces).interference
    assert inter is not None
    assert (inter.spike > 1.5) is stalls


def test_hf_tiny_llama(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    Tokenizer.default().save(tmp_path / "tokenizer.json")
    target = open_target(f"hf:{tmp_path}")
    assert target.model_config().d_model == 64 and target.describe()["kind"] == "hf"
    traces = target.run(_requests(target, 16, 2, 4, 2), concurrency=2)
    for t in traces:
        _check_timeline(t, 4)
    with pytest.raises(UserError, match="no config.json"):
        open_target(f"hf:{tmp_path / 'missing'}")


METRICS = """# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 4
sglang:time_to_first_token_seconds_sum{model_name="m"} 2.0
sglang:time_to_first_token_seconds_count{model_name="m"} 4
# TYPE sglang:queue_time_seconds histogram
sglang:queue_time_seconds_sum{model_name="m"} 0.4
sglang:queue_time_seconds_count{model_name="m"} 4
# TYPE vllm:request_decode_time_seconds histogram
vllm:request_decode_time_seconds_sum{model_name="m"} 3.0
vllm:request_decode_time_seconds_count{model_name="m"} 4
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{model_name="m"} 104
"""


def test_prometheus_phase_means_from_any_naming() -> None:
    samples = prometheus.parse_samples(METRICS)
    small = prometheus._parse_small(METRICS)  # the fallback parser agrees with prometheus_client
    assert all(small[k] == v for k, v in samples.items() if k in small)
    assert small["sglang:queue_time_seconds_sum"] == 0.4
    means = prometheus.phase_means_s({}, samples)
    assert means["ttft"] == pytest.approx(0.5) and means["queue"] == pytest.approx(0.1)
    assert means["prefill"] == pytest.approx(0.4)  # SGLang: TTFT minus queue
    assert means["itl"] == pytest.approx(3.0 / (104 - 4))  # decode seconds over decode steps
    assert prometheus.known_metrics(samples)


def test_prometheus_cache_dtype_from_vllm_and_ours() -> None:
    vllm = ('# TYPE vllm:cache_config_info gauge\n'
            'vllm:cache_config_info{block_size="16",cache_dtype="fp8_e5m2",num_gpu_blocks="9"} 1\n')
    assert prometheus.cache_dtype(vllm) == "fp8_e5m2"
    assert prometheus.cache_dtype(vllm.replace("fp8_e5m2", "fp8_inc")) == "fp8"  # one byte
    assert prometheus.cache_dtype(vllm.replace("fp8_e5m2", "auto")) == "auto"
    ours = 'splitphase:cache_config_info{cache_dtype="bfloat16",model_name="m"} 1.0\n'
    assert prometheus.cache_dtype(METRICS + ours) == "bfloat16"
    assert prometheus.cache_dtype(METRICS) is None
    assert prometheus.cache_dtype('other_info{cache_dtype="fp8"} 1\n') is None


def test_prometheus_pool_tokens_from_vllm_and_ours() -> None:
    vllm = 'vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="9"} 1\n'
    assert prometheus.kv_pool_tokens(vllm) == 144
    assert prometheus.kv_pool_tokens(vllm.replace('"9"', '"None"')) is None  # not profiled yet
    ours = ('splitphase:cache_config_info{block_size="16",cache_dtype="float32",'
            'model_name="m",num_gpu_blocks="40"} 1.0\n')
    assert prometheus.kv_pool_tokens(METRICS + ours) == 640
    assert prometheus.cache_dtype(ours) == "float32"
    no_size = ours.replace('block_size="16",', "")  # half a statement is none
    assert prometheus.kv_pool_tokens(no_size) is None and prometheus.cache_dtype(no_size)
    assert prometheus.kv_pool_tokens(METRICS) is None
    sglang = ('sglang:max_total_num_tokens{model_name="m",tp_rank="0"} 161721.0\n'
              'sglang:max_total_num_tokens{model_name="m",tp_rank="1"} 161721.0\n')
    assert prometheus.kv_pool_tokens(METRICS + sglang) == 161721  # per rank, not summed


def test_prometheus_max_num_seqs_from_ours_and_sglang() -> None:
    ours = ('splitphase:scheduler_config_info{max_num_batched_tokens="2048",max_num_seqs="64",'
            'model_name="m",policy="chunked"} 1.0\n')
    assert prometheus.max_num_seqs(METRICS + ours) == 64
    assert prometheus.scheduler_policy(ours) == "chunked"
    assert prometheus.scheduler_policy(METRICS) is None
    sglang = 'sglang:max_running_requests{model_name="m",tp_rank="0"} 4096\n'
    assert prometheus.max_num_seqs(METRICS + sglang) == 4096
    assert prometheus.max_num_seqs(METRICS) is None  # vLLM states none


def test_prometheus_model_dtype_from_ours_only() -> None:
    ours = 'splitphase:model_config_info{dtype="bfloat16",model_name="m"} 1.0\n'
    assert prometheus.model_dtype(METRICS + ours) == "bfloat16"
    assert prometheus.model_dtype(METRICS) is None


def test_openai_target_states_the_servers_cache_dtype_and_pool() -> None:
    for stated, blocks in (("fp8", 100), (None, None)):
        with FakeOpenAIServer(FakeTiming(cache_dtype=stated, num_gpu_blocks=blocks)) as url:
            target = open_target(f"openai:{url}", ModelConfig.from_name("tiny"))
            assert target.describe()["kv_cache_dtype"] == stated
            assert target.describe()["kv_pool_tokens"] == (1600 if blocks else None)
            target.close()


@pytest.mark.parametrize(("timing", "stated"), [
    (FakeTiming(server_info={"kv_cache_dtype": "bf16", "max_total_num_tokens": 5000,
                             "max_running_requests": 48}), ("bfloat16", 5000, 48)),
    (FakeTiming(server_info={"kv_cache_dtype": "fp8_e5m2"}), ("fp8_e5m2", None, None)),
    (FakeTiming(server_info={"model_path": "m"}), (None, None, None)),
    (FakeTiming(cache_dtype="fp8", num_gpu_blocks=10,  # /metrics, where stated, wins
                server_info={"kv_cache_dtype": "auto", "max_total_num_tokens": 5000}),
     ("fp8", 160, None)),
])
def test_sglang_states_its_cache_in_its_server_info(timing: FakeTiming, stated: tuple) -> None:
    with FakeOpenAIServer(timing) as url:
        target = open_target(f"openai:{url}", ModelConfig.from_name("tiny"))
        described = target.describe()
        target.close()
    assert (described["kv_cache_dtype"], described["kv_pool_tokens"],
            described["max_num_seqs"]) == stated


def test_sglang_names_its_weights_and_model_path_in_its_server_info() -> None:
    # Served as "default" (--served-model-name): the model path names the preset, the server
    # arguments the quantization (SGLang's own name for vLLM's fp8).
    info = {"model_path": "meta-llama/Llama-3.1-8B-Instruct", "quantization": "w8a8_fp8"}
    with FakeOpenAIServer(FakeTiming(model_id="default", server_info=info)) as url:
        target = open_target(f"openai:{url}")
        assert target.model_config() == ModelConfig.from_name("llama-3.1-8b")
        described = target.describe()
        target.close()
    assert described["quantization"] == "fp8"
    assert described["model_config_source"] == (
        "served model root 'meta-llama/Llama-3.1-8B-Instruct'")


def test_builtin_counts_the_preemptions_of_a_pool_too_small(tiny_ckpt: Path) -> None:
    from splitphase.engine.config import EngineConfig
    from splitphase.engine.llm_engine import LLMEngine

    target = BuiltinTarget(str(tiny_ckpt))
    assert target.describe()["preemptions"] == 0
    # Four 40-token prompts that each grow to 72 tokens (5 blocks) in a pool of 8 blocks.
    target._engine = LLMEngine(target._model, target._tok,
                               EngineConfig(num_blocks=8, max_num_batched_tokens=256))
    traces = target.run(_requests(target, 40, 4, 32, 4), concurrency=4)
    for t in traces:
        _check_timeline(t, 32)
    assert sum(t.preemptions for t in traces) == target.describe()["preemptions"] > 0


def test_builtin_stores_its_pool_in_the_given_dtype(tiny_ckpt: Path) -> None:
    target = BuiltinTarget(str(tiny_ckpt), kv_cache_dtype="fp8")
    try:
        assert target.describe()["kv_cache_dtype"] == "fp8"
        assert target._engine.kv_dtype_bytes == 1
        blocks = target._engine.scheduler.block_manager.num_blocks
        assert target.describe()["kv_pool_tokens"] == blocks * 16 > 0
        assert target._engine.kv_pool_blocks == blocks and target._engine.kv_block_size == 16
        assert target.describe()["max_num_seqs"] == 64
        traces = target.run(_requests(target, 24, 2, 4, 2), concurrency=2)
    finally:
        target.close()
    for t in traces:
        _check_timeline(t, 4)
    plain = BuiltinTarget(str(tiny_ckpt))
    assert plain.describe()["kv_cache_dtype"] == "float32"  # "auto": the model's own
    plain.close()


def test_hf_targets_refuse_a_kv_cache_dtype() -> None:
    with pytest.raises(UserError, match="hf: target keeps K/V"):
        open_target("hf:/nonexistent", kv_cache_dtype="fp8")


def test_workload_files(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    rows = [{"input_length": 9000, "output_length": 300}, {"prompt_tokens": 50, "output_tokens": 8}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    pairs = load_workload(path, max_seq_len=1024, quick=True)
    assert pairs == ((1024 - 256, 256), (50, 8))  # clipped to the context
    path.write_text('{"prompt_tokens": 5}\n')
    with pytest.raises(UserError, match="w.jsonl:1"):
        load_workload(path, 1024, True)
    path.write_text("not json\n")
    with pytest.raises(UserError, match="not valid JSON"):
        load_workload(path, 1024, True)


def test_default_plan_scales_with_context() -> None:
    small = plan_for(1024)
    assert small.prompt_lens == (32, 64, 128, 256, 512) and small.concurrency_levels == (1, 2, 4, 8)
    quick = plan_for(1024, quick=True)
    assert len(quick.prompt_lens) == 3 and max(quick.prompt_lens) + quick.output_tokens <= 1024
    assert max(plan_for(131072).prompt_lens) == 4096


def test_interference_injects_land_inside_streams_capped_by_the_context() -> None:
    # A sweep of a fast engine with one slow first token (a busy machine): the streams are
    # capped by the context, so the long prompts must come early enough to overlap them.
    plan = plan_for(256, quick=True)
    short, long_ = min(plan.prompt_lens), max(plan.prompt_lens)
    sweep = [RequestTrace(short, 9, 0.0, ttft, [ttft + 0.001 * i for i in range(9)], ttft + 0.008)
             for ttft in (0.05, 0.05, 0.05, 2.0)]
    sweep.append(RequestTrace(long_, 9, 0.0, 0.1, [0.1 + 0.001 * i for i in range(9)], 0.108))
    reqs = interference_requests(plan, PromptMaker(_codec()), sweep, 256)
    streams = [r for r in reqs if r.role == "stream"]
    injects = [r for r in reqs if r.role == "inject"]
    life_s = streams[0].output_tokens * 0.001  # the sweep's inter-token latency
    assert streams[0].output_tokens == 256 - short - 1  # capped by the context
    assert len(injects) == 2 and all(0 < r.start_offset_s <= 2 * life_s / 3 for r in injects)
