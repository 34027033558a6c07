"""Fault injection: a forward that raises, 200 client timeouts, and a stuck engine loop."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from splitphase.engine.llm import LLM
from splitphase.reliability.ledger import Ledger
from splitphase.reliability.loadgen import Outcome, stream_request
from splitphase.reliability.probe import finished_total, scrape, wait_at_rest, wait_for
from splitphase.server.state import ServerState

Serve = Callable[..., tuple[str, LLM, ServerState]]  # the serve_inproc fixture
BODY = {"prompt": "fault", "max_tokens": 100, "ignore_eos": True, "temperature": 0}


class Forward:
    """Wraps the runner's forward: optional sleep per call, raises on call number `fail_at`."""

    def __init__(self, llm: LLM, sleep_s: float = 0.0) -> None:
        runner = llm.engine.runner  # type: ignore[union-attr]
        self.real, self.sleep_s, self.calls, self.fail_at = runner.execute, sleep_s, 0, -1
        self.gate: threading.Event | None = None
        runner.execute = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.gate is not None:
            self.gate.wait(30)
        time.sleep(self.sleep_s)
        if self.calls == self.fail_at:
            raise RuntimeError(f"injected fault on forward {self.calls}")
        return self.real(*args, **kwargs)


def test_forward_raising_on_its_nth_call_errors_every_request_in_it(
        serve_inproc: Serve, ledger: Ledger) -> None:
    url, llm, _ = serve_inproc()
    forward = Forward(llm, sleep_s=0.01)
    sdk = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
    streams: list[Outcome] = []
    plain: list[BaseException | None] = []

    async def streamed() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            streams.extend(await asyncio.gather(*(
                stream_request(client, url + "/v1/completions", {**BODY, "stream": True,
                                                                 "prompt": f"s{i}"})
                for i in range(6))))

    def one_plain(i: int) -> None:
        try:
            sdk.completions.create(model=llm_model(url), prompt=f"p{i}", max_tokens=100,
                                   extra_body={"ignore_eos": True})
            plain.append(None)
        except openai.APIError as exc:
            plain.append(exc)

    before = finished_total(scrape(url))
    workers = [threading.Thread(target=lambda: asyncio.run(streamed()))]
    workers += [threading.Thread(target=one_plain, args=(i,)) for i in range(4)]
    for w in workers:
        w.start()
    # All 10 requests are running (decoding) when the forward fails.
    wait_for(lambda: llm.engine.scheduler.num_running, lambda n: n == 10, 10, 0.002)  # type: ignore[union-attr]
    forward.fail_at = forward.calls + 2
    for w in workers:
        w.join(30)
    assert len(streams) == 6 and len(plain) == 4
    assert all(o.explicit_error and o.error_code == "engine_step_failed" for o in streams), [
        (o.status, o.error_code, o.malformed) for o in streams]
    assert all(isinstance(e, openai.InternalServerError) and e.code == "engine_step_failed"
               for e in plain), plain
    done = sdk.completions.create(model=llm_model(url), prompt="next", max_tokens=4)
    assert done.choices[0].finish_reason == "length"
    metrics, _ = wait_at_rest(url, 5)
    assert finished_total(metrics) - before == 11  # 10 errors and the next one
    assert httpx.get(url + "/health", timeout=5).json()["step_errors"] == 1
    ledger.record("fault injection", "model forward raises on its Nth call, 10 requests in it",
                  "6 streams ended with an `engine_step_failed` error event and [DONE], 4 "
                  "plain requests got a 500 in OpenAI shape (SDK, max_retries=0); the next "
                  "request completed; KV back to 0", held=11, faults=1)


def llm_model(url: str) -> str:
    """The id the server serves (the checkpoint path)."""
    return str(httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["id"])


# The anchor must still be running when its client gives up: 200 tokens at >= 0.02 s a
# forward take >= 4 s, and it gives up after 2 s.
ANCHOR_TIMEOUT_S, ANCHOR_TOKENS = 2.0, 200


async def anchored_flood(url: str, model: str, llm: LLM) -> list[BaseException | None]:
    """One anchor request seen running in the engine, then 199 more; each one's exception.

    Whether any of a bare flood reaches the engine before its 0.5 s timeout depends on how
    fast a loaded event loop admits them (none did once), so the anchor makes one abort of a
    running request certain.
    """
    anchor_sdk = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                                    timeout=ANCHOR_TIMEOUT_S)
    sdk = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=0.5)

    async def one(client: openai.AsyncOpenAI, prompt: str, tokens: int) -> BaseException | None:
        try:
            await client.completions.create(model=model, prompt=prompt, max_tokens=tokens,
                                            extra_body={"ignore_eos": True})
            return None
        except openai.APIError as exc:
            return exc

    scheduler = llm.engine.scheduler  # type: ignore[union-attr]
    try:
        anchor = asyncio.ensure_future(one(anchor_sdk, "anchor", ANCHOR_TOKENS))
        t0 = time.monotonic()
        while scheduler.num_running == 0 and not anchor.done():
            assert time.monotonic() - t0 < ANCHOR_TIMEOUT_S, "the anchor never ran"
            await asyncio.sleep(0.002)
        assert not anchor.done(), anchor.result()  # it ended before it was seen running
        rest = await asyncio.gather(*(one(sdk, f"t{i}", 40) for i in range(199)))
        return [await anchor, *rest]
    finally:
        await asyncio.gather(sdk.close(), anchor_sdk.close())


def test_200_client_timeouts_then_a_fresh_request_is_prompt(
        serve_inproc: Serve, ledger: Ledger) -> None:
    url, llm, _ = serve_inproc()
    Forward(llm, sleep_s=0.02)  # 40 tokens take >= 0.8 s: none finishes within 0.5 s
    model = llm_model(url)
    before, _ = wait_at_rest(url, 10)
    errors = asyncio.run(anchored_flood(url, model, llm))
    timeouts = sum(isinstance(e, openai.APITimeoutError) for e in errors)
    assert timeouts == 200, [type(e).__name__ for e in errors][:10]
    t0 = time.perf_counter()
    fresh = httpx.post(url + "/v1/completions", json={"prompt": "fresh", "max_tokens": 4},
                       timeout=30)
    fresh_s = time.perf_counter() - t0
    assert fresh.status_code == 200
    assert fresh_s < 5.0, fresh_s  # the abandoned 200 were aborted, not served first
    metrics, rest_s = wait_at_rest(url, 10)
    assert metrics["num_requests_running"] == 0 and metrics["num_requests_waiting"] == 0
    assert metrics["kv_cache_blocks_used"] == 0
    assert httpx.get(url + "/health", timeout=5).json()["in_flight"] == 0

    def count(m: dict[str, float], reason: str) -> int:
        return int(m.get(f"request_success_total|{reason}", 0))

    aborted = count(metrics, "abort") - count(before, "abort")
    # The anchor at least was running when its client gave up; none may run to its length.
    assert count(metrics, "length") - count(before, "length") == 1  # the fresh request only
    assert aborted >= 1
    ledger.record("fault injection", "200 requests time out client-side (199 after 0.5 s, "
                  "one seen running after 2 s)",
                  f"200 client timeouts (SDK, max_retries=0), {aborted} of them aborted on "
                  f"the server; a fresh request then completed "
                  f"in {fresh_s:.2f} s; running/waiting/KV gauges at 0 {rest_s:.1f} s later",
                  held=201, faults=200)


@pytest.mark.parametrize("where", ["in a forward", "before taking the request"])
def test_a_stuck_engine_loop_is_reported_unhealthy(
        serve_inproc: Serve, ledger: Ledger, where: str) -> None:
    url, llm, state = serve_inproc(health_stall_s=0.5)
    gate = threading.Event()
    if where == "in a forward":
        Forward(llm).gate = gate  # the next forward blocks until the gate opens
    else:  # the engine thread blocks in a command: the request is admitted, never added
        entered = threading.Event()

        def block() -> None:
            entered.set()
            gate.wait(30)

        threading.Thread(target=lambda: asyncio.run(state.engine.call(block)),
                         daemon=True).start()
        assert entered.wait(10)
    assert httpx.get(url + "/health", timeout=5).status_code == 200
    result: list[httpx.Response] = []
    client = threading.Thread(target=lambda: result.append(httpx.post(
        url + "/v1/completions", json={"prompt": "stuck", "max_tokens": 2}, timeout=30)))
    client.start()
    try:
        resp, stuck_s = wait_for(lambda: httpx.get(url + "/health", timeout=5),
                                 lambda r: r.status_code == 503, 10)
        assert resp.status_code == 503
        assert "no engine step" in resp.json()["reason"], resp.json()
    finally:
        gate.set()
    client.join(30)
    assert result and result[0].status_code == 200
    healthy, _ = wait_for(lambda: httpx.get(url + "/health", timeout=5),
                          lambda r: r.status_code == 200, 10)
    assert healthy.status_code == 200
    ledger.record("fault injection", f"engine loop stuck {where} (stall limit 0.5 s)",
                  f"/health turned 503 \"no engine step ...\" after {stuck_s:.1f} s and "
                  "200 again once it moved; the request completed", held=1, faults=1)
