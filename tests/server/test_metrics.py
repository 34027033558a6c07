"""ServerMetrics alone: what steps and finished requests add to the counters dashboards read,
and the dtype the server states."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from splitphase.engine.llm_engine import StepRecord
from splitphase.engine.request import Request
from splitphase.server.metrics import ServerMetrics


def _samples(metrics: ServerMetrics) -> dict[str, float]:
    text = metrics.render().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith(("splitphase:num_preemptions", "splitphase:prefix_cache"))
            and s.name.endswith("_total")}


def test_preemptions_and_prefix_cache_tokens_count_as_steps_happen() -> None:
    metrics = ServerMetrics("m", None, "float32")
    assert _samples(metrics) == {"splitphase:num_preemptions_total": 0.0,
                                 "splitphase:prefix_cache_queries_total": 0.0,
                                 "splitphase:prefix_cache_hits_total": 0.0}
    # Two steps of requests still running: the counters move before any request finishes.
    metrics.on_steps([StepRecord(0, "prefill", 48, 0, 0.1, 1.0, 1.0, 0.0, 0, 48, 32),
                      StepRecord(1, "decode", 0, 3, 0.1, 1.0, 1.0, 0.0, 2, 0, 0)])
    assert _samples(metrics) == {"splitphase:num_preemptions_total": 2.0,
                                 "splitphase:prefix_cache_queries_total": 48.0,
                                 "splitphase:prefix_cache_hits_total": 32.0}
    finished = Request("a", list(range(1, 41)), num_preemptions=2, num_cached_tokens=32)
    metrics.observe_finished("length", finished, 1.0)
    metrics.observe_finished("abort", None, 1.0)  # never reached the engine
    assert _samples(metrics)["splitphase:num_preemptions_total"] == 2  # not counted twice


def test_step_and_request_token_histograms() -> None:
    metrics = ServerMetrics("m", None, "float32")
    metrics.on_steps([StepRecord(0, "prefill", 300, 0, 0.1, 1.0, 1.0),
                      StepRecord(1, "mixed", 40, 6, 0.1, 1.0, 1.0),
                      StepRecord(2, "decode", 0, 6, 0.1, 1.0, 1.0)])
    request = Request("a", list(range(1, 41)), output_token_ids=[7] * 12)
    metrics.observe_finished("length", request, 1.0)
    text = metrics.render().decode()
    hists = {s.name + str(s.labels.get("le", "")): s.value
             for f in text_string_to_metric_families(text) for s in f.samples}
    assert hists["splitphase:iteration_tokens_total_count"] == 3
    assert hists["splitphase:iteration_tokens_total_sum"] == 300 + 46 + 6
    assert hists["splitphase:iteration_tokens_total_bucket8.0"] == 1  # the decode step's 6
    assert hists["splitphase:iteration_tokens_total_bucket64.0"] == 2
    assert hists["splitphase:request_prompt_tokens_sum"] == 40
    assert hists["splitphase:request_generation_tokens_sum"] == 12
    assert hists["splitphase:request_generation_tokens_bucket20.0"] == 1


def test_the_server_states_the_dtype_it_computes_in() -> None:
    text = ServerMetrics("m", None, "bfloat16").render().decode()
    assert 'splitphase:model_config_info{dtype="bfloat16",model_name="m"} 1.0' in text
