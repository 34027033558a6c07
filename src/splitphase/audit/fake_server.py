"""A tiny OpenAI-compatible SSE server with a known timing model: a test double for audits.

Prefill of a prompt takes `prefill_base_s + prefill_s_per_token * prompt_tokens`, then one token
every `itl_s`. One simulated device is shared: with `mixed=True` a prefill stalls every stream's
next token until it ends (prefill batched with decode), otherwise streams never wait. `/metrics`
exposes vLLM-named histograms unless `metrics=False`; `burst=True` sends all text in one chunk;
`openai=False` answers 404 HTML to everything (a server that is not OpenAI-compatible).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

CHARS_PER_TOKEN = 4  # the fake tokenizer: one token per 4 characters of prompt


@dataclass
class FakeTiming:
    """The fake server's timing model, seconds."""

    prefill_base_s: float = 0.002
    prefill_s_per_token: float = 2e-5
    itl_s: float = 0.002
    mixed: bool = False
    burst: bool = False
    metrics: bool = True
    openai: bool = True
    cache_dtype: str | None = None  # stated in vLLM's cache_config_info when set
    num_gpu_blocks: int | None = None  # likewise (16 tokens a block)
    preemptions_per_request: int = 0  # counted in vllm:num_preemptions_total as each finishes
    server_info: dict[str, Any] | None = None  # SGLang's GET /get_server_info when set
    model_id: str = "fake-model"  # what /v1/models lists


class _State:
    def __init__(self, timing: FakeTiming) -> None:
        self.timing = timing
        self.lock = threading.Lock()
        self.device_free_s = 0.0  # perf_counter time when the running prefill ends
        self.hist: dict[str, list[float]] = {}  # name -> [sum, count]
        self.generated = 0.0
        self.preemptions = 0

    def observe(self, name: str, value_s: float) -> None:
        with self.lock:
            entry = self.hist.setdefault(name, [0.0, 0.0])
            entry[0] += value_s
            entry[1] += 1

    def metrics_text(self) -> str:
        lines = []
        with self.lock:
            for name, (total, count) in sorted(self.hist.items()):
                lines += [f"# TYPE {name} histogram",
                          f'{name}_bucket{{le="+Inf",model_name="fake"}} {count}',
                          f'{name}_sum{{model_name="fake"}} {total}',
                          f'{name}_count{{model_name="fake"}} {count}']
            lines += ["# TYPE vllm:generation_tokens counter",
                      f'vllm:generation_tokens_total{{model_name="fake"}} {self.generated}',
                      "# TYPE vllm:num_preemptions counter",
                      f'vllm:num_preemptions_total{{model_name="fake"}} {self.preemptions}']
            if self.timing.cache_dtype is not None:
                lines += ["# TYPE vllm:cache_config_info gauge",
                          f'vllm:cache_config_info{{block_size="16",cache_dtype='
                          f'"{self.timing.cache_dtype}",enable_prefix_caching="True",'
                          f'num_gpu_blocks="{self.timing.num_gpu_blocks}"}} 1.0']
        return "\n".join(lines) + "\n"


def _handler(state: _State) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib name
            pass  # keep test output clean

        def _send(self, code: int, body: str, kind: str = "application/json") -> None:
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if not state.timing.openai:
                self._send(404, "<html><body>Not Found</body></html>", "text/html")
            elif self.path == "/v1/models":
                card = {"id": state.timing.model_id, "object": "model", "max_model_len": 2048}
                self._send(200, json.dumps({"object": "list", "data": [card]}))
            elif self.path == "/metrics" and state.timing.metrics:
                self._send(200, state.metrics_text(), "text/plain; version=0.0.4")
            elif self.path == "/get_server_info" and state.timing.server_info is not None:
                self._send(200, json.dumps(state.timing.server_info))
            else:
                self._send(404, json.dumps({"error": {"message": "not found"}}))

        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if not state.timing.openai or self.path != "/v1/completions":
                self._send(404, "<html><body>Not Found</body></html>", "text/html")
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            _stream(self, state, body)

    return Handler


def _event(handler: BaseHTTPRequestHandler, obj: Any) -> None:
    payload = obj if isinstance(obj, str) else json.dumps(obj)
    handler.wfile.write(f"data: {payload}\n\n".encode())
    handler.wfile.flush()


def _wait_for_device(state: _State) -> None:
    """Under mixed scheduling a decode step cannot run while a prefill holds the device."""
    if state.timing.mixed:
        with state.lock:
            free_s = state.device_free_s
        delay_s = free_s - time.perf_counter()
        if delay_s > 0:
            time.sleep(delay_s)


def _stream(handler: BaseHTTPRequestHandler, state: _State, body: dict[str, Any]) -> None:
    timing = state.timing
    prompt_tokens = max(1, len(str(body.get("prompt", ""))) // CHARS_PER_TOKEN)
    n = int(body.get("max_tokens") or 16)
    arrive_s = time.perf_counter()
    prefill_s = timing.prefill_base_s + timing.prefill_s_per_token * prompt_tokens
    with state.lock:  # one simulated device: prefills run one after another
        start_s = max(arrive_s, state.device_free_s)
        state.device_free_s = start_s + prefill_s
    time.sleep(max(0.0, start_s + prefill_s - time.perf_counter()))
    first_s = time.perf_counter()
    chunk = {"object": "text_completion", "model": state.timing.model_id}
    if timing.burst:
        _event(handler, {**chunk, "choices": [{"index": 0, "text": "tok " * n,
                                                "finish_reason": "length"}]})
    else:
        for i in range(n):
            if i:
                time.sleep(timing.itl_s)
                _wait_for_device(state)
            last = "length" if i == n - 1 else None
            _event(handler, {**chunk, "choices": [{"index": 0, "text": "tok ",
                                                    "finish_reason": last}]})
    end_s = time.perf_counter()
    with state.lock:  # counted before the histograms a scraper waits on
        state.generated += n
        state.preemptions += timing.preemptions_per_request
    for name, value in (("vllm:request_queue_time_seconds", start_s - arrive_s),
                        ("vllm:request_prefill_time_seconds", prefill_s),
                        ("vllm:time_to_first_token_seconds", first_s - arrive_s),
                        ("vllm:request_decode_time_seconds", end_s - first_s)):
        state.observe(name, value)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n,
             "total_tokens": prompt_tokens + n}
    _event(handler, {**chunk, "choices": [], "usage": usage})
    _event(handler, "[DONE]")


class FakeOpenAIServer:
    """Start with `with FakeOpenAIServer(FakeTiming(...)) as url:` on a free 127.0.0.1 port."""

    def __init__(self, timing: FakeTiming | None = None) -> None:
        self.state = _State(timing or FakeTiming())
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self.state))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def __enter__(self) -> str:
        self._thread.start()
        return self.url

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
