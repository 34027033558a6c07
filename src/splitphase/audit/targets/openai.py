"""`openai:URL`: any OpenAI-compatible server, probed with streaming `/v1/completions`.

Token counts come from the stream's usage chunk (`stream_options.include_usage`); every SSE
chunk that carries a token is timestamped on arrival. When `/metrics` has vLLM's, SGLang's or
our phase histograms, each probe point's server-side queue, prefill and decode step times are
attached to its traces and preferred by the profile over client-side estimates.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import Any

from splitphase.audit.targets import prometheus
from splitphase.audit.targets.base import Codec, TokenizerCodec
from splitphase.audit.trace import ProbeRequest, RequestTrace, trace_for
from splitphase.audit.weights import quantization_in_config, quantization_in_name
from splitphase.errors import UserError
from splitphase.model.config import PRESETS, ConfigError, ModelConfig
from splitphase.model.config_sources import (
    config_doc,
    load_model_config,
    local_model_dir,
    preset_for_model_id,
)
from splitphase.model.tokenizer import Tokenizer

TIMEOUT_S = 120.0


def _httpx() -> Any:
    try:
        import httpx
    except ImportError as exc:  # pragma: no cover - httpx ships with the server extras
        raise UserError("openai: targets need httpx; run `pip install httpx`") from exc
    return httpx


def normalize_url(url: str) -> str:
    """Base URL without a trailing slash or `/v1`; `http://` is added when no scheme is given."""
    url = url.strip().rstrip("/")
    if not url:
        raise UserError("openai: target needs a URL, e.g. openai:http://127.0.0.1:8000")
    if "://" not in url:
        url = f"http://{url}"
    return url.removesuffix("/v1")


def _json_or_error(resp: Any, what: str) -> Any:
    if resp.status_code != 200:
        raise UserError(
            f"{what} returned HTTP {resp.status_code}: not an OpenAI-compatible server "
            f"(expected 200 and JSON); check the URL and port"
        )
    try:
        return resp.json()
    except ValueError as exc:
        kind = resp.headers.get("content-type", "unknown type")
        raise UserError(
            f"{what} returned {kind}, not JSON: not an OpenAI-compatible server; check the URL"
        ) from exc


SGLANG_CACHE_DTYPES = {"bf16": "bfloat16"}  # its other names are vLLM's and ours


class OpenAITarget:
    """A running OpenAI-compatible HTTP server; geometry from `--model-config`."""

    def __init__(self, url: str, model_config: ModelConfig | None = None) -> None:
        self.url = normalize_url(url)
        self._cfg = model_config
        self._client = _httpx().Client(timeout=TIMEOUT_S)
        self.served_model, self.served_root, self.max_model_len = self._models()
        self.geometry_source = None if model_config is None else "--model-config"
        self._preflight()
        text = self._metrics_text()  # one GET: which histograms, and the K/V cache's config
        self.metrics = self._samples(text) is not None
        self.kv_cache_dtype = prometheus.cache_dtype(text) if text is not None else None
        self.kv_pool_tokens = prometheus.kv_pool_tokens(text) if text is not None else None
        self.max_num_seqs = prometheus.max_num_seqs(text) if text is not None else None
        self.policy = prometheus.scheduler_policy(text) if text is not None else None
        self.model_dtype = prometheus.model_dtype(text) if text is not None else None
        self._server_quantization: str | None = None  # as SGLang's server info names it
        if self.kv_cache_dtype is None:  # SGLang states its cache in its server info instead
            self._read_server_info()
        self.preemptions: int | None = None  # over the probe, where the server counts them
        self.quantization = self._stated_quantization()
        self._codec = TokenizerCodec(Tokenizer.default())

    def _get(self, path: str) -> Any:
        httpx = _httpx()
        try:
            return self._client.get(self.url + path)
        except httpx.HTTPError as exc:
            raise UserError(
                f"cannot reach {self.url} ({type(exc).__name__}: {exc}); is the server running? "
                "check the host and port"
            ) from exc

    def _models(self) -> tuple[str | None, str | None, int | None]:
        data = _json_or_error(self._get("/v1/models"), f"GET {self.url}/v1/models")
        cards = data.get("data") if isinstance(data, dict) else None
        if not isinstance(cards, list):
            raise UserError(
                f"GET {self.url}/v1/models has no `data` list: not an OpenAI-compatible server"
            )
        if not cards or not isinstance(cards[0], dict):
            return None, None, None
        card = cards[0]
        max_len, root = card.get("max_model_len"), card.get("root")  # root: vLLM's model path
        return (card.get("id"), root if isinstance(root, str) else None,
                int(max_len) if isinstance(max_len, int) else None)

    def _body(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,  # vLLM/SGLang/ours: decode exactly max_tokens
            "temperature": 0,
        }
        if self.served_model:
            body["model"] = self.served_model
        return body

    def _preflight(self) -> None:
        httpx = _httpx()
        what = f"POST {self.url}/v1/completions"
        try:
            with self._client.stream(
                "POST", self.url + "/v1/completions", json=self._body("Hello", 2)
            ) as resp:
                lines = [line for line in resp.iter_lines() if line.startswith("data:")]
                status = resp.status_code
        except httpx.HTTPError as exc:
            raise UserError(f"{what} failed ({type(exc).__name__}: {exc})") from exc
        if status != 200:
            raise UserError(
                f"{what} returned HTTP {status}: not an OpenAI-compatible completions endpoint"
            )
        try:
            json.loads(lines[0][5:])
        except (IndexError, ValueError) as exc:
            raise UserError(f"{what} did not stream `data: {{json}}` events (SSE)") from exc

    def _stated_quantization(self) -> str | None:
        """The weights' format the served model states: its config.json's quantization_config
        where it is a directory on this machine, else a word of its name (`...-FP8`)."""
        names = [name for _, name in self._names()]
        for name in names:
            local = local_model_dir(name)
            doc = config_doc(local) if local is not None else None
            if doc is not None:
                return quantization_in_config(doc)
        if self._server_quantization is not None:
            return self._server_quantization
        return next((q for n in names if (q := quantization_in_name(n))), None)

    def _read_server_info(self) -> None:
        """SGLang's GET /get_server_info: its server args, the K/V cache dtype among them."""
        try:
            resp = self._client.get(self.url + "/get_server_info")
            info = resp.json() if resp.status_code == 200 else None
        except (_httpx().HTTPError, ValueError):
            return
        if not isinstance(info, dict):
            return
        dtype = info.get("kv_cache_dtype")
        if isinstance(dtype, str):
            self.kv_cache_dtype = SGLANG_CACHE_DTYPES.get(dtype, dtype)
        quant = info.get("quantization")  # its --quantization: fp8, awq, gptq, w8a8_fp8, ...
        if isinstance(quant, str):
            self._server_quantization = quantization_in_name(quant)
        path = info.get("model_path")  # where its weights live: a directory, or a hub name
        if self.served_root is None and isinstance(path, str):
            self.served_root = path
        for attr, key in (("kv_pool_tokens", "max_total_num_tokens"),
                          ("max_num_seqs", "max_running_requests")):
            value = info.get(key)
            if getattr(self, attr) is None and isinstance(value, int) and value > 0:
                setattr(self, attr, value)

    def _metrics_text(self) -> str | None:
        try:
            resp = self._client.get(self.url + "/metrics")
        except _httpx().HTTPError:
            return None
        return resp.text if resp.status_code == 200 else None

    @staticmethod
    def _samples(text: str | None) -> dict[str, float] | None:
        if text is None:
            return None
        samples = prometheus.parse_samples(text)
        return samples if prometheus.known_metrics(samples) else None

    def _scrape(self) -> dict[str, float] | None:
        return self._samples(self._metrics_text())

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "openai",
            "spec": f"openai:{self.url}",
            "url": self.url,
            "model": self.served_model,
            "max_model_len": self.max_model_len,
            "runner": "streaming POST /v1/completions (httpx)",
            "concurrent_streams": True,
            "server_metrics": self.metrics,
            # As /metrics (or SGLang's server info) states them; None: not stated.
            "kv_cache_dtype": self.kv_cache_dtype,
            "kv_pool_tokens": self.kv_pool_tokens,
            "max_num_seqs": self.max_num_seqs,
            "policy": self.policy,  # the batching policy, where the server states it
            "preemptions": self.preemptions,
            "model_config_source": self.geometry_source,  # None: not asked for yet
            "quantization": self.quantization,  # the weights' format its model states
            "model_dtype": self.model_dtype,  # the dtype it computes in, where it states it
        }

    def model_config(self) -> ModelConfig:
        if self._cfg is None:
            cfg = self._config_from_served_name()
            if self.model_dtype is not None and self.model_dtype != cfg.dtype:
                try:  # the server computes in another dtype than its config.json states
                    cfg = cfg.with_(dtype=self.model_dtype)
                    self.geometry_source = (f"{self.geometry_source}, computing in "
                                            f"{self.model_dtype} (its /metrics)")
                except ConfigError:
                    pass  # a dtype the model config does not know: the file's stands
            self._cfg = cfg
        return self._cfg

    def _names(self) -> list[tuple[str, str]]:
        """The served model's names, the path it was loaded from (`root`) first."""
        return [(what, name) for what, name in (("root", self.served_root),
                                                ("id", self.served_model)) if name]

    def _config_from_served_name(self) -> ModelConfig:
        """The geometry the served model's name gives, as vLLM users give none: its config.json
        where the name (or vLLM's `root`) is a model directory on this machine, else the preset
        the name names; anything else needs --model-config."""
        named = self._names()
        for what, name in named:
            local = local_model_dir(name)
            try:
                cfg = load_model_config(str(local)) if local is not None else None
            except ConfigError:
                cfg = None  # not a model we can read: the name may still name a preset
            if cfg is not None:
                self.geometry_source = (f"served model {what} {name!r}, its config.json on "
                                        "this machine")
                return cfg
        for what, name in reversed(named):
            preset = preset_for_model_id(name)
            if preset is not None:
                self.geometry_source = f"served model {what} {name!r}"
                return ModelConfig.from_name(preset)
        what = f"serves {self.served_model!r}" if self.served_model else "names no model"
        raise UserError(
            f"openai: the server {what}, and no preset matches ({', '.join(PRESETS)}; a name "
            "in a weight format the audit cannot price, such as GGUF, matches none): pass "
            "--model-config NAME or PATH to the model's config.json"
        )

    def codec(self) -> Codec:
        return self._codec

    def close(self) -> None:
        self._client.close()

    def run(self, requests: Sequence[ProbeRequest], concurrency: int) -> list[RequestTrace]:
        before = self._scrape() if self.metrics else None
        traces = asyncio.run(self._run_all(requests, concurrency))
        if before is not None:
            self._attach_server_times(traces, before)
        return traces

    def _attach_server_times(self, traces: list[RequestTrace], before: dict[str, float]) -> None:
        done = sum(t.ok for t in traces)
        after = self._scrape()
        for _ in range(5):  # servers may record a request a moment after its stream ends
            if after is None or prometheus.observations(before, after) >= done:
                break
            time.sleep(0.1)
            after = self._scrape()
        if after is None:
            return
        preempted = prometheus.preemptions(before, after)
        if preempted is not None:
            self.preemptions = (self.preemptions or 0) + preempted
        means = prometheus.phase_means_s(before, after)
        for t in traces:
            t.server_queue_s = means.get("queue")
            t.server_prefill_s = means.get("prefill")
            t.server_itl_s = means.get("itl")

    async def _run_all(
        self, requests: Sequence[ProbeRequest], concurrency: int
    ) -> list[RequestTrace]:
        httpx = _httpx()
        gate = asyncio.Semaphore(max(1, concurrency))
        limits = httpx.Limits(max_connections=max(1, concurrency) + 4)
        async with httpx.AsyncClient(timeout=TIMEOUT_S, limits=limits) as client:
            start_s = time.perf_counter()

            async def one(req: ProbeRequest) -> RequestTrace:
                delay_s = start_s + req.start_offset_s - time.perf_counter()
                if delay_s > 0:
                    await asyncio.sleep(delay_s)
                async with gate:
                    return await self._stream(client, req)

            return list(await asyncio.gather(*(one(r) for r in requests)))

    async def _stream(self, client: Any, req: ProbeRequest) -> RequestTrace:
        trace = trace_for(req, time.perf_counter())
        usage: dict[str, Any] = {}
        try:
            async with client.stream(
                "POST", self.url + "/v1/completions", json=self._body(req.prompt_text,
                                                                      req.output_tokens)
            ) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread()).decode("utf-8", "replace")[:200]
                    trace.error = f"HTTP {resp.status_code}: {body}"
                    return trace
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    if not _on_event(trace, line[5:].strip(), usage, time.perf_counter()):
                        break
        except (_httpx().HTTPError, ValueError) as exc:
            trace.error = f"{type(exc).__name__}: {exc}"
        trace.end_s = time.perf_counter()
        trace.first_token_s = trace.token_times_s[0] if trace.token_times_s else None
        trace.output_tokens = int(usage.get("completion_tokens") or len(trace.token_times_s))
        trace.prompt_tokens = int(usage.get("prompt_tokens") or req.prompt_tokens)
        if trace.error is None and not trace.token_times_s:
            trace.error = "the stream carried no tokens"
        return trace


def _on_event(trace: RequestTrace, payload: str, usage: dict[str, Any], now_s: float) -> bool:
    """Record one SSE event; False at `[DONE]`."""
    if payload == "[DONE]":
        return False
    event = json.loads(payload)
    if event.get("error"):
        trace.error = str(event["error"])[:200]
        return False
    if isinstance(event.get("usage"), dict):
        usage.update(event["usage"])
    for choice in event.get("choices") or []:
        # A last chunk with no text that only says why it stopped carries no token.
        if choice.get("text") or choice.get("finish_reason") is None:
            trace.token_times_s.append(now_s)
    return True
