"""API key, full queue, SIGTERM drain, and a failing forward: the server keeps its promises."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from splitphase.engine.llm import LLM
from splitphase.engine.sampling_params import SamplingParams
from splitphase.server.app import create_app
from splitphase.server.config import ServerConfig
from splitphase.server.errors import APIError
from splitphase.server.generation import Generation
from splitphase.server.process import ServerProcess
from splitphase.server.sse import run_to_end

KEY = "s3cret-key"
ENGINE_MODES = ["--no-engine-process", "--engine-process"]  # as in conftest's `server`
LONG = {"prompt": [0, *range(300, 340)], "max_tokens": 200, "ignore_eos": True}


@pytest.fixture(scope="module")
def guarded(tiny_ckpt: Path, launch: Callable[..., ServerProcess]) -> Iterator[ServerProcess]:
    proc = launch(tiny_ckpt, "--api-key", KEY, "--max-num-seqs", "1", "--max-queue", "0")
    yield proc
    proc.stop()
    assert KEY not in proc.log()  # the key is never logged


def _auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_api_key_required_but_health_open(guarded: ServerProcess) -> None:
    url = guarded.url + "/v1/completions"
    body = {"prompt": "hi", "max_tokens": 2}
    for headers in ({}, _auth("wrong"), {"Authorization": KEY}):
        resp = httpx.post(url, json=body, headers=headers, timeout=10)
        assert resp.status_code == 401, headers
        assert resp.json()["error"]["type"] == "authentication_error"
    assert httpx.post(url, json=body, headers=_auth(), timeout=10).status_code == 200
    assert httpx.get(guarded.url + "/health", timeout=10).status_code == 200
    assert httpx.get(guarded.url + "/v1/models", timeout=10).status_code == 401


def test_full_queue_is_429_with_retry_after(guarded: ServerProcess) -> None:
    with httpx.Client(timeout=30, headers=_auth()) as client, client.stream(
        "POST", guarded.url + "/v1/completions", json={**LONG, "stream": True}
    ) as stream:
        lines = stream.iter_lines()  # keep it: a dropped iterator closes the connection
        assert next(lines).startswith("data: ")
        resp = client.post(guarded.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert resp.status_code == 429, resp.text
        assert resp.headers["Retry-After"] == "1"
        assert "queue is full" in resp.json()["error"]["message"]
        too_big = client.post(guarded.url + "/v1/completions",
                              json={"prompt": "x", "max_tokens": 1, "n": 2})
        assert too_big.status_code == 400 and "at most 1" in too_big.text


@pytest.mark.parametrize("mode", ENGINE_MODES)
def test_sigterm_drains_in_flight_and_refuses_new(tiny_ckpt: Path,
                                                  launch: Callable[..., ServerProcess],
                                                  mode: str) -> None:
    proc = launch(tiny_ckpt, "--max-num-seqs", "1", mode)
    results: list[httpx.Response] = []
    try:
        # One seat: two queued non-streamed requests keep the drain busy behind the stream.
        workers = [threading.Thread(target=lambda: results.append(httpx.post(
            proc.url + "/v1/completions", json=LONG, timeout=60))) for _ in range(2)]
        with httpx.Client(timeout=60) as client, client.stream(
            "POST", proc.url + "/v1/completions", json={**LONG, "stream": True}
        ) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            for w in workers:
                w.start()
            # Both queued requests are admitted before the signal. The stream may be done by
            # then (its tokens wait in the socket): an engine in its own process is fast.
            while (httpx.get(proc.url + "/health", timeout=10).json()["in_flight"]
                   + _finished_requests(proc) < 3):
                time.sleep(0.002)
            assert proc.proc is not None
            proc.proc.send_signal(signal.SIGTERM)
            refused = client.post(proc.url + "/v1/completions", json={"prompt": "x"})
            assert refused.status_code == 503, refused.text
            assert httpx.get(proc.url + "/health", timeout=10).status_code == 503
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        for w in workers:
            w.join(60)
        assert [r.status_code for r in results] == [200, 200]
        assert proc.proc.wait(30) == 0
    finally:
        proc.stop()
    assert "drained" in proc.log()


def _finished_requests(proc: ServerProcess) -> int:
    """Requests the server finished so far (its end-to-end latency histogram's count)."""
    text = httpx.get(proc.url + "/metrics", timeout=10).text
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
               if line.startswith("splitphase:e2e_request_latency_seconds_count"))


@pytest.fixture(scope="module")
def app_client(tiny_ckpt: Path) -> Iterator[TestClient]:
    app = create_app(ServerConfig(model=str(tiny_ckpt), hardware="h100", max_step_records=16),
                     llm=LLM(model=str(tiny_ckpt)))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def test_failed_forward_errors_its_request_and_server_goes_on(app_client: TestClient,
                                                              monkeypatch) -> None:
    state = app_client.app.state.splitphase  # type: ignore[attr-defined]
    runner = state.llm.engine.runner
    real, calls = runner.execute, {"n": 0, "fail_at": -1}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == calls["fail_at"]:
            raise RuntimeError("injected fault")
        return real(*args, **kwargs)

    def fail_second_forward() -> None:  # the prefill works, the first decode step raises
        calls["fail_at"] = calls["n"] + 2

    monkeypatch.setattr(runner, "execute", flaky)
    body = {"prompt": "hello", "max_tokens": 8, "ignore_eos": True}
    fail_second_forward()
    resp = app_client.post("/v1/completions", json=body)
    assert resp.status_code == 500 and resp.json()["error"]["code"] == "engine_step_failed"
    assert "injected fault" in resp.json()["error"]["message"]
    assert app_client.post("/v1/completions", json=body).status_code == 200
    fail_second_forward()
    with app_client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "engine_step_failed" in events[-2]
    assert json.loads(events[0])["choices"][0]["text"] is not None  # the first token came
    assert app_client.post("/v1/completions", json=body).status_code == 200
    assert state.llm.engine.scheduler.block_manager.num_used_blocks == 0
    assert app_client.get("/health").json()["step_errors"] == 2


def test_draining_app_answers_503(app_client: TestClient) -> None:
    state = app_client.app.state.splitphase  # type: ignore[attr-defined]
    state.begin_drain()
    try:
        resp = app_client.post("/v1/chat/completions",
                               json={"messages": [{"role": "user", "content": "x"}]})
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "shutting_down"
        assert app_client.get("/health").status_code == 503
    finally:
        state.draining = False


def test_step_records_stay_bounded(app_client: TestClient) -> None:
    body = {"prompt": "bounded", "max_tokens": 40, "ignore_eos": True}
    assert app_client.post("/v1/completions", json=body).status_code == 200
    assert len(app_client.app.state.splitphase.llm.engine.steps) <= 16  # type: ignore[attr-defined]


def test_non_streamed_request_aborts_when_its_client_leaves(app_client: TestClient,
                                                            monkeypatch) -> None:
    state = app_client.app.state.splitphase  # type: ignore[attr-defined]
    runner, real = state.llm.engine.runner, state.llm.engine.runner.execute

    def slow(*args, **kwargs):
        time.sleep(0.01)
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", slow)

    class Gone:  # a client that has disconnected
        async def is_disconnected(self) -> bool:
            return True

    async def main() -> int:
        gen = Generation(state, "gone", [[0, 5, 6]],
                         SamplingParams(max_tokens=200, ignore_eos=True))
        gen.admit()
        try:
            with pytest.raises(APIError, match="closed the connection"):
                await run_to_end(gen, Gone(), poll_s=0.05)  # type: ignore[arg-type]
        finally:
            await gen.close()
        await asyncio.sleep(0.1)  # the abort runs on the engine thread before the next step
        return gen.output_tokens

    assert asyncio.run(main()) < 200
    assert state.in_flight == 0
    assert state.llm.engine.scheduler.block_manager.num_used_blocks == 0


def test_a_crashed_engine_loop_fails_requests_with_503(tiny_ckpt: Path, monkeypatch) -> None:
    llm = LLM(model=str(tiny_ckpt))
    app = create_app(ServerConfig(model=str(tiny_ckpt), hardware="h100"), llm=llm)

    def broken() -> list:
        raise AssertionError("scheduler bug")

    with TestClient(app, raise_server_exceptions=False) as client:
        monkeypatch.setattr(llm.engine, "step", broken)
        resp = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4})
        assert resp.status_code == 503, resp.text
        assert client.get("/health").status_code == 503
        again = client.post("/v1/completions", json={"prompt": "x"})
        assert again.status_code == 503 and again.json()["error"]["code"] == "engine_unavailable"


def test_a_killed_engine_core_fails_its_streams_then_answers_503(
        tiny_ckpt: Path, launch: Callable[..., ServerProcess]) -> None:
    proc = launch(tiny_ckpt, "--engine-process")
    try:
        pid = httpx.get(proc.url + "/health", timeout=10).json()["engine_core_pid"]
        with httpx.Client(timeout=30) as client, client.stream(
            "POST", proc.url + "/v1/completions", json={**LONG, "stream": True}
        ) as stream:
            lines = (line for line in stream.iter_lines() if line.startswith("data: "))
            assert "choices" in next(lines)
            os.kill(pid, signal.SIGKILL)
            rest = list(lines)
        assert rest[-1] == "data: [DONE]"
        assert "error" in json.loads(rest[-2][6:])  # an error event, not a cut stream
        refused = httpx.post(proc.url + "/v1/completions", json={"prompt": "x"}, timeout=10)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "engine_unavailable"
        health = httpx.get(proc.url + "/health", timeout=10)
        assert health.status_code == 503 and not health.json()["engine_running"]
    finally:
        proc.stop()
