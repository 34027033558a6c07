"""Raw HTTP against `splitphase serve`: error shapes, disconnects, concurrency, metrics."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitphase.audit.targets import prometheus
from splitphase.engine.llm import LLM
from splitphase.engine.sampling_params import SamplingParams
from splitphase.server.process import ServerProcess

HISTOGRAMS = ("time_to_first_token_seconds", "request_queue_time_seconds",
              "request_prefill_time_seconds", "request_decode_time_seconds",
              "e2e_request_latency_seconds", "time_per_output_token_seconds")


def _post(server: ServerProcess, path: str, body: object, **kw: object) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=30, **kw)  # type: ignore[arg-type]


def _metrics(server: ServerProcess) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.endswith("_bucket"):
                key = s.name + "".join(f"|{v}" for k, v in sorted(s.labels.items())
                                       if k != "model_name")
                out[key] = out.get(key, 0.0) + s.value
    return out


def _assert_openai_error(resp: httpx.Response, status: int, *words: str) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for w in words:
        assert w in err["message"], err["message"]
    assert "Traceback" not in resp.text
    return err


@pytest.mark.parametrize("body, words, param", [
    ({"prompt": "x", "max_tokens": "five"}, ["max_tokens", "integer"], "max_tokens"),
    ({"prompt": "x", "max_tokens": 1000}, ["1000", "256"], "prompt"),
    ({"prompt": "x", "temperature": -0.5}, ["temperature", "-0.5"], "temperature"),
    ({"prompt": "x", "top_p": 1.5}, ["top_p", "1.5"], "top_p"),
    ({"prompt": "x", "n": 99}, ["n", "99", "16"], "n"),
    ({"prompt": "x", "logprobs": 50}, ["logprobs", "50"], "logprobs"),
    ({"prompt": "x", "model": "gpt-4o"}, ["gpt-4o"], "model"),
    ({"prompt": [70000]}, ["70000", "4096"], "prompt"),
    ({"prompt": []}, ["empty"], "prompt"),
    ({"prompt": "x", "stream": "yes"}, ["stream"], "stream"),
    ({"max_tokens": 3}, ["prompt", "required"], "prompt"),
])
def test_invalid_fields_are_400_with_the_numbers(server: ServerProcess, body: dict,
                                                  words: list[str], param: str) -> None:
    err = _assert_openai_error(_post(server, "/v1/completions", body), 400, *words)
    assert err["param"] == param and err["type"] == "invalid_request_error"


def test_chat_errors_and_unknown_extra_fields(server: ServerProcess) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    _assert_openai_error(_post(server, "/v1/chat/completions", {"messages": []}), 400, "messages")
    _assert_openai_error(_post(server, "/v1/chat/completions",
                               {"messages": [{"role": "robot", "content": "x"}]}), 400, "robot")
    _assert_openai_error(_post(server, "/v1/chat/completions",
                               {"messages": msgs, "max_completion_tokens": 999}), 400, "999")
    ok = _post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2,
                                                "guidellm_extra": {"a": 1}, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_bad_json_404_405_and_413(server: ServerProcess) -> None:
    resp = httpx.post(server.url + "/v1/completions", content=b'{"prompt": ', timeout=10)
    _assert_openai_error(resp, 400, "not valid JSON")
    resp = httpx.post(server.url + "/v1/completions", content=b"[1, 2]", timeout=10)
    _assert_openai_error(resp, 400)
    _assert_openai_error(httpx.get(server.url + "/v2/nothing", timeout=10), 404, "/v2/nothing")
    _assert_openai_error(httpx.delete(server.url + "/v1/completions", timeout=10), 405)
    big = json.dumps({"prompt": "x" * (5 * 2**20)}).encode()
    _assert_openai_error(httpx.post(server.url + "/v1/completions", content=big, timeout=30),
                         413, str(4 * 2**20))


def test_openapi_health_and_tokenizer_routes(server: ServerProcess) -> None:
    spec = httpx.get(server.url + "/openapi.json", timeout=10).json()
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize"} <= set(spec["paths"])
    assert httpx.get(server.url + "/health", timeout=10).json()["engine_running"] is True
    text = "Hello, wörld! <|endoftext|> 你好"
    tok = _post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 256
    assert 0 in tok["tokens"]  # special-token text parses, as HF tokenizers do
    back = _post(server, "/detokenize", {"tokens": tok["tokens"]}).json()
    assert back["prompt"] == text
    info = httpx.get(server.url + "/tokenizer_info", timeout=10).json()
    assert info["eos_token"] == "<|endoftext|>" and "<|assistant|>" in info["chat_template"]
    chat = _post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"][:2] == [0, 2]  # bos, <|user|>


def test_disconnect_mid_stream_aborts_and_frees_blocks(server: ServerProcess) -> None:
    before = _metrics(server)
    body = {"prompt": [0, *range(300, 340)], "max_tokens": 200, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=30) as client, \
            client.stream("POST", server.url + "/v1/completions", json=body) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")
        during = _metrics(server)
        assert during["splitphase:kv_cache_blocks_used"] > 0
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        after = _metrics(server)
        if after["splitphase:kv_cache_blocks_used"] == 0:
            break
        time.sleep(0.05)
    assert after["splitphase:kv_cache_blocks_used"] == 0
    assert after["splitphase:num_requests_running"] == 0
    aborted = "splitphase:request_success_total|abort"
    assert after[aborted] == before[aborted] + 1
    assert after["splitphase:generation_tokens_total"] - before[
        "splitphase:generation_tokens_total"] < 200


def test_50_concurrent_streams_equal_offline_greedy(server: ServerProcess,
                                                    tiny_ckpt: Path) -> None:
    prompts = [f"Prompt number {i}: " + "word " * (i % 7) for i in range(50)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = [c.text for c in LLM(model=str(tiny_ckpt)).generate(prompts, params)]

    async def one(client: httpx.AsyncClient, prompt: str) -> str:
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True,
                "ignore_eos": True}
        text = []
        async with client.stream("POST", server.url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += [c["text"] for c in json.loads(line[6:])["choices"]]
        return "".join(text)

    async def main() -> list[str]:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as c:
            return list(await asyncio.gather(*(one(c, p) for p in prompts)))

    assert asyncio.run(main()) == expected


def test_metrics_parse_and_histograms_count_finished_requests(server: ServerProcess) -> None:
    before = _metrics(server)
    for i in range(5):
        resp = _post(server, "/v1/completions", {"prompt": f"m{i}", "max_tokens": 3 + i,
                                                 "ignore_eos": True})
        assert resp.status_code == 200
    after = _metrics(server)
    finished = sum(after[k] - before.get(k, 0.0) for k in after
                   if k.startswith("splitphase:request_success_total"))
    assert finished == 5
    for name in HISTOGRAMS:
        key = f"splitphase:{name}_count"
        assert after[key] - before[key] == 5, name
    assert after["splitphase:generation_tokens_total"] - before[
        "splitphase:generation_tokens_total"] == sum(3 + i for i in range(5))
    itl = after["splitphase:inter_token_latency_seconds_count"] - before[
        "splitphase:inter_token_latency_seconds_count"]
    assert itl == sum(2 + i for i in range(5))
    assert after["splitphase:kv_cache_blocks_total"] > 0
    for gauge in ("prefill_flops_utilization", "decode_bandwidth_utilization"):
        assert 0 < after[f"splitphase:{gauge}"] < 1, gauge
    # "auto" pool: the info metric states the model's dtype (the audit prices decode with it).
    text = httpx.get(server.url + "/metrics", timeout=10).text
    assert 'cache_dtype="float32"' in text
    assert prometheus.cache_dtype(text) == "float32"
    assert prometheus.max_num_seqs(text) == 32  # --max-num-seqs, for the audit
    pool = prometheus.kv_pool_tokens(text)  # blocks x block_size, as vLLM's info states it
    assert pool == 16 * after["splitphase:kv_cache_blocks_total"]  # one pool: the same blocks
    # The same 40-token prompt again: its two full blocks come from the prefix cache.
    prompt = list(range(100, 140))
    for _ in range(2):
        assert _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1}).is_success
    again = _metrics(server)
    looked_up, found = (again[f"splitphase:prefix_cache_{k}_total"]
                        - after[f"splitphase:prefix_cache_{k}_total"] for k in ("queries", "hits"))
    assert looked_up == 80 and found == 32
    assert again["splitphase:num_preemptions_total"] == 0
