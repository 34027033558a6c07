"""ServerMetrics alone: what steps and finished requests add to the counters dashboards read,
and the dtype the server states."""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitphase.engine.llm import LLM
from splitphase.engine.llm_engine import StepRecord
from splitphase.engine.request import Request
from splitphase.model.checkpoint import read_config, resolve_model_dir
from splitphase.model.config import ConfigError
from splitphase.server.metrics import ServerMetrics
from splitphase.server.state import served_dtype


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


def test_the_served_dtype_follows_dtype_when_the_engine_runs_apart() -> None:
    # With the engine in its own process the server holds no model: `serve --dtype bfloat16`
    # must still state bf16 (cache_config_info, the utilization gauges), not the checkpoint's.
    apart = cast(LLM, SimpleNamespace(model=None))
    small = resolve_model_dir("small")
    assert served_dtype(apart, small, None) == read_config(small)[0].dtype == "float32"
    assert served_dtype(apart, small, "bfloat16") == "bfloat16"
    assert served_dtype(apart, None, None) == "bfloat16"
    with pytest.raises(ConfigError):
        served_dtype(apart, small, "int8")
    text = ServerMetrics("m", None, "bfloat16").render().decode()
    assert 'splitphase:model_config_info{dtype="bfloat16",model_name="m"} 1.0' in text
