"""Load: 200 open-loop streaming clients against the embedded model, nothing lost or leaked."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from splitphase.reliability.ledger import Ledger
from splitphase.reliability.loadgen import open_loop, summarize
from splitphase.reliability.probe import finished_total, scrape, wait_at_rest
from splitphase.server.process import ServerProcess

CLIENTS = 200
RATE_PER_S = 1000.0  # Poisson arrivals: all 200 sent within about 0.2 s
MAX_TOKENS = 16
TOPICS = ["the river", "a small engine", "the last train", "cache blocks", "a quiet city"]


def _requests(url: str, n: int) -> tuple[list[str], list[dict]]:
    """Half completions, half chat completions; greedy, MAX_TOKENS each."""
    urls, bodies = [], []
    for i in range(n):
        text = f"Story {i} about {TOPICS[i % len(TOPICS)]}:" + " and then" * (i % 4)
        body = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
        if i % 2:
            urls.append(url + "/v1/chat/completions")
            bodies.append({**body, "messages": [{"role": "user", "content": text}]})
        else:
            urls.append(url + "/v1/completions")
            bodies.append({**body, "prompt": text})
    return urls, bodies


def test_200_streaming_clients_open_loop(launch: Callable[..., ServerProcess],
                                         ledger: Ledger) -> None:
    # 32 running + 128 waiting seats: a burst of 200 must meet explicit 429s, not a hang.
    proc = launch("small", "--max-num-seqs", "32", "--max-queue", "128")
    try:
        assert proc.url.startswith("http://127.0.0.1:")  # loopback only
        before = finished_total(scrape(proc.url))
        urls, bodies = _requests(proc.url, CLIENTS)
        outcomes, wall_s = asyncio.run(open_loop(urls, bodies, RATE_PER_S, timeout_s=120))
        s = summarize(outcomes, wall_s)
        lost = [o for o in outcomes if o.lost]
        assert not lost, [(o.status, o.malformed, o.error_code) for o in lost[:5]]
        assert s["completed"] + s["refused_429"] + s["refused_503"] + s["error_events"] == CLIENTS
        assert s["error_events"] == 0 and s["refused_503"] == 0
        assert s["completed"] >= 100 and s["peak_concurrency"] >= 150, s
        assert all(o.events == MAX_TOKENS for o in outcomes if o.completed)
        after, waited_s = wait_at_rest(proc.url, timeout_s=10)
        assert after["kv_cache_blocks_used"] == 0 and after["num_requests_running"] == 0
        # Every response received is one finished request on the server, and nothing else is.
        assert finished_total(after) - before == sum(o.status == 200 for o in outcomes)
    finally:
        assert proc.stop() == 0, proc.log()[-3000:]
    ledger.record(
        "load", f"{CLIENTS} streaming clients (half chat), open loop (Poisson "
        f"{RATE_PER_S:g}/s), embedded `small`, {MAX_TOKENS} tokens each",
        f"{s['completed']} full streams ending in [DONE], {s['refused_429']} explicit 429, "
        f"peak {s['peak_concurrency']} in flight; TTFT p50/p99 {_ms(s['ttft_p50_s'])}/"
        f"{_ms(s['ttft_p99_s'])} ms, ITL p50/p99 {_ms(s['itl_p50_s'])}/{_ms(s['itl_p99_s'])} "
        f"ms; KV blocks back to 0 within {waited_s:.1f} s; finished counter = responses",
        held=CLIENTS, lost=len(lost), figures=s)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"
