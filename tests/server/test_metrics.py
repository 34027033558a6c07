"""ServerMetrics alone: what one finished request adds to the counters vLLM dashboards read."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from splitphase.engine.request import Request
from splitphase.server.metrics import ServerMetrics


def _samples(metrics: ServerMetrics) -> dict[str, float]:
    text = metrics.render().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith(("splitphase:num_preemptions", "splitphase:prefix_cache"))
            and s.name.endswith("_total")}


def test_preemptions_and_prefix_cache_tokens_count_as_requests_finish() -> None:
    metrics = ServerMetrics("m", None, "float32")
    assert _samples(metrics) == {"splitphase:num_preemptions_total": 0.0,
                                 "splitphase:prefix_cache_queries_total": 0.0,
                                 "splitphase:prefix_cache_hits_total": 0.0}
    twice = Request("a", list(range(1, 41)), num_preemptions=2, num_cached_tokens=32)
    twice.prefill_len = 48  # its latest prefill: the prompt and 8 tokens it had made
    metrics.observe_finished("length", twice, 1.0)
    logprobs = Request("b", list(range(1, 21)), use_prefix_cache=False)  # never looked up
    logprobs.prefill_len = 20
    metrics.observe_finished("stop", logprobs, 1.0)
    metrics.observe_finished("abort", None, 1.0)  # never reached the engine
    assert _samples(metrics) == {"splitphase:num_preemptions_total": 2.0,
                                 "splitphase:prefix_cache_queries_total": 48.0,
                                 "splitphase:prefix_cache_hits_total": 32.0}
