"""Open-loop streaming load against an OpenAI-compatible server, checked byte by byte.

Open loop: request i is sent at its arrival time whether or not earlier ones have finished
(constant spacing, or Poisson arrivals: exponential gaps at `rate_per_s`), so a slow server
builds a queue the clients see, instead of closed-loop clients politely waiting and hiding the
tail. Each streamed answer is read as raw bytes and checked: every event is `data: <json>`
followed by a blank line, the last is `data: [DONE]`, and the stream ends with a finish
reason or an OpenAI-shaped `error` event. Anything else (a cut stream, a half-written event,
a 5xx, a hang past the timeout) counts as lost.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

DONE = b"data: [DONE]"
REFUSED = (429, 503)  # explicit "not now" answers a client may retry


@dataclass
class Outcome:
    """What one request got, client-side."""

    status: int = 0  # HTTP status; 0 if no response came
    events: int = 0  # SSE data events, [DONE] excluded
    done: bool = False  # the stream ended with `data: [DONE]`
    finish_reason: str | None = None  # of the last choice event
    error_code: str | None = None  # an `error` event's (or error body's) code
    malformed: str | None = None  # why the bytes were not a well-formed stream
    text: str = ""
    ttft_s: float | None = None  # send -> first event carrying text
    gaps_s: list[float] = field(default_factory=list)  # between text-carrying events
    transport_error: str | None = None  # timeout, reset, ...
    sent_s: float = 0.0  # perf_counter when sent and when the answer ended
    ended_s: float = 0.0

    @property
    def completed(self) -> bool:
        """A full response: 200, well formed, a finish reason, then [DONE]."""
        return (self.status == 200 and self.done and self.malformed is None
                and self.finish_reason is not None and self.error_code is None)

    @property
    def refused(self) -> bool:
        """An explicit 429/503 before the stream started."""
        return self.status in REFUSED

    @property
    def explicit_error(self) -> bool:
        """A well-formed stream that ended with an `error` event and [DONE]."""
        return (self.status == 200 and self.done and self.malformed is None
                and self.error_code is not None)

    @property
    def lost(self) -> bool:
        """Neither a full response, nor an explicit refusal or error: a broken promise."""
        return not (self.completed or self.refused or self.explicit_error)


def parse_sse(raw: bytes, out: Outcome) -> list[dict[str, Any]]:
    """The JSON events of a raw SSE body; sets `done` and `malformed` on `out`."""
    events: list[dict[str, Any]] = []
    if not raw.endswith(b"\n\n"):
        out.malformed = "the stream does not end with a blank line (cut mid-event)"
    blocks = [b for b in raw.split(b"\n\n") if b]
    for i, block in enumerate(blocks):
        if not block.startswith(b"data: "):
            out.malformed = f"event {i} is not a `data:` line: {block[:60]!r}"
            break
        if block == DONE:
            out.done = i == len(blocks) - 1
            if not out.done:
                out.malformed = "events after [DONE]"
            break
        try:
            events.append(json.loads(block[6:]))
        except ValueError:
            out.malformed = f"event {i} is not JSON: {block[:60]!r}"
            break
    return events


def _apply(events: list[dict[str, Any]], out: Outcome) -> None:
    for ev in events:
        if "error" in ev:
            out.error_code = str(ev["error"].get("code") or ev["error"].get("type"))
            continue
        for choice in ev.get("choices", []):
            out.finish_reason = choice.get("finish_reason") or out.finish_reason
            delta = choice.get("text")
            if delta is None:
                delta = (choice.get("delta") or {}).get("content")
            out.text += delta or ""
        out.events += 1


async def stream_request(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                         headers: dict[str, str] | None = None) -> Outcome:
    """POST a streaming request to `url` and check what comes back."""
    out = Outcome()
    t0 = last = out.sent_s = time.perf_counter()
    chunks: list[bytes] = []
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            out.status = resp.status_code
            async for chunk in resp.aiter_raw():
                now = time.perf_counter()
                chunks.append(chunk)
                if resp.status_code == 200 and (b'"text"' in chunk or b'"content"' in chunk):
                    if out.ttft_s is None:
                        out.ttft_s = now - t0
                    else:
                        out.gaps_s.append(now - last)
                    last = now
    except httpx.HTTPError as exc:
        out.transport_error = f"{type(exc).__name__}: {exc}"
    out.ended_s = time.perf_counter()
    raw = b"".join(chunks)
    if out.status == 200:
        _apply(parse_sse(raw, out), out)
    elif out.status:
        try:
            out.error_code = str(json.loads(raw)["error"]["code"])
        except (ValueError, KeyError, TypeError):
            out.malformed = f"HTTP {out.status} without an OpenAI error body"
    if out.transport_error is not None:
        out.malformed = out.malformed or out.transport_error
    return out


def arrival_times(n: int, rate_per_s: float, poisson: bool = True,
                  seed: int = 0) -> list[float]:
    """Send offsets in seconds: constant spacing, or exponential gaps (a Poisson process)."""
    if n < 1 or rate_per_s <= 0:
        raise ValueError(f"need n >= 1 and rate_per_s > 0, got {n}, {rate_per_s}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate_per_s) if poisson else 1.0 / rate_per_s
    return out


async def open_loop(url: str | Sequence[str], bodies: Sequence[dict[str, Any]],
                    rate_per_s: float, poisson: bool = True, seed: int = 0,
                    timeout_s: float = 60.0,
                    headers: dict[str, str] | None = None) -> tuple[list[Outcome], float]:
    """Send `bodies` (to `url`, or each to its own) at their arrival times, all at once in
    flight; returns (outcomes, wall seconds)."""
    offsets = arrival_times(len(bodies), rate_per_s, poisson, seed)
    urls = [url] * len(bodies) if isinstance(url, str) else list(url)
    limits = httpx.Limits(max_connections=len(bodies) + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        t0 = time.perf_counter()

        async def one(offset_s: float, target: str, body: dict[str, Any]) -> Outcome:
            await asyncio.sleep(max(0.0, t0 + offset_s - time.perf_counter()))
            try:
                return await asyncio.wait_for(stream_request(client, target, body, headers),
                                              timeout_s)
            except asyncio.TimeoutError:
                return Outcome(transport_error=f"no end within {timeout_s} s",
                               malformed="hang")

        outcomes = await asyncio.gather(*(one(o, u, b) for o, u, b in
                                          zip(offsets, urls, bodies, strict=True)))
        return list(outcomes), time.perf_counter() - t0


def percentile(xs: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 1]); None for no samples."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def peak_concurrency(outcomes: Sequence[Outcome]) -> int:
    """The most requests in flight at once, client-side."""
    edges = sorted([(o.sent_s, 1) for o in outcomes if o.ended_s]
                   + [(o.ended_s, -1) for o in outcomes if o.ended_s])
    peak = now = 0
    for _, step in edges:
        now += step
        peak = max(peak, now)
    return peak


def summarize(outcomes: Sequence[Outcome], wall_s: float) -> dict[str, Any]:
    """Counts (completed, refused, errored, lost) and client-side TTFT / ITL percentiles."""
    ttft = [o.ttft_s for o in outcomes if o.completed and o.ttft_s is not None]
    itl = [g for o in outcomes if o.completed for g in o.gaps_s]
    return {
        "requests": len(outcomes),
        "completed": sum(o.completed for o in outcomes),
        "refused_429": sum(o.status == 429 for o in outcomes),
        "refused_503": sum(o.status == 503 for o in outcomes),
        "error_events": sum(o.explicit_error for o in outcomes),
        "lost": sum(o.lost for o in outcomes),
        "peak_concurrency": peak_concurrency(outcomes),
        "wall_s": wall_s,
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p99_s": percentile(ttft, 0.99),
        "itl_p50_s": percentile(itl, 0.5),
        "itl_p99_s": percentile(itl, 0.99),
    }
