"""Read a running server's state from outside: Prometheus gauges and counters, bounded waits."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import httpx
from prometheus_client.parser import text_string_to_metric_families

T = TypeVar("T")
PREFIX = "splitphase:"
GAUGES_AT_REST = ("num_requests_running", "num_requests_waiting", "kv_cache_blocks_used")


def scrape(url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """`/metrics` as {name or name|label-values: value}, summed over model_name."""
    text = httpx.get(url + "/metrics", timeout=timeout_s).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_bucket"):
                continue
            key = s.name.removeprefix(PREFIX) + "".join(
                f"|{v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[key] = out.get(key, 0.0) + s.value
    return out


def finished_total(metrics: dict[str, float]) -> float:
    """Requests the server counted as finished, any reason (request_success_total)."""
    return sum(v for k, v in metrics.items() if k.startswith("request_success_total|"))


def wait_for(fn: Callable[[], T], ok: Callable[[T], bool], timeout_s: float,
             interval_s: float = 0.05) -> tuple[T, float]:
    """Poll `fn` until `ok` (or the timeout); (last value, seconds waited)."""
    t0 = time.monotonic()
    value = fn()
    while not ok(value) and time.monotonic() - t0 < timeout_s:
        time.sleep(interval_s)
        value = fn()
    return value, time.monotonic() - t0


def at_rest(metrics: dict[str, float]) -> bool:
    """No request running or waiting, no KV block in use."""
    return all(metrics.get(g, 0.0) == 0 for g in GAUGES_AT_REST)


def wait_at_rest(url: str, timeout_s: float = 10.0) -> tuple[dict[str, float], float]:
    """Poll /metrics until the server is at rest; (last scrape, seconds waited)."""
    return wait_for(lambda: scrape(url), at_rest, timeout_s)
