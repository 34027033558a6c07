"""The event loop: colocated and disaggregated clusters, prefix hits, routing, metrics."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitphase.engine.scheduler import SchedulerConfig
from splitphase.hardware.specs import get_hardware, get_link
from splitphase.model.config import ModelConfig
from splitphase.sim.cluster import ClusterConfig, PoolConfig
from splitphase.sim.metrics import SLO, percentile, summarize
from splitphase.sim.simulator import simulate
from splitphase.sim.workload import parse_workload

CFG = ModelConfig.from_name("llama-3.1-8b")
HW = get_hardware("h100-sxm")
SAMPLE = Path(__file__).parent / "mooncake_sample.jsonl"


def _sched(policy: str = "chunked", role: str | None = None, prefix: bool = False
           ) -> SchedulerConfig:
    return SchedulerConfig(policy=policy, role=role, max_num_seqs=64,
                           max_num_batched_tokens=2048, num_blocks=4000,
                           enable_prefix_caching=prefix)


def _disagg(link: str = "nvlink") -> ClusterConfig:
    return ClusterConfig(prefill=PoolConfig(1, 1, _sched("disaggregated", "prefill")),
                         decode=PoolConfig(2, 1, _sched("disaggregated", "decode")),
                         link=get_link(link))


def test_every_request_finishes_with_its_output_length() -> None:
    reqs = parse_workload("chat").with_rate(4).generate(60, 1, 8192)
    for cluster in (ClusterConfig(colocated=PoolConfig(2, 1, _sched())), _disagg()):
        res = simulate(cluster, CFG, HW, reqs)
        assert len(res.records) == 60
        by = {r.index: r for r in res.records}
        for q in reqs:
            rec = by[q.index]
            assert rec.output_len == q.output_len and rec.prompt_len == q.prompt_len
            assert rec.arrival_s <= rec.first_token_s <= rec.finished_s


def test_disaggregation_pays_kv_transfer_on_the_link() -> None:
    reqs = parse_workload("rag").with_rate(2).generate(30, 2, 16384)
    fast = simulate(_disagg("nvlink"), CFG, HW, reqs)
    slow = simulate(_disagg("ethernet"), CFG, HW, reqs)
    assert slow.kv_transfer_s > 10 * fast.kv_transfer_s > 0
    tpot = [percentile([t for r in x.records if (t := r.tpot_s) is not None], 50)
            for x in (fast, slow)]
    assert tpot[1] > tpot[0]


def test_trace_prefix_hashes_become_cache_hits() -> None:
    reqs = parse_workload(f"trace:{SAMPLE}").with_rate(2).generate(40)
    cached, hit_rate = {}, {}
    for prefix in (False, True):
        cluster = ClusterConfig(colocated=PoolConfig(1, 1, SchedulerConfig(
            policy="chunked", max_num_seqs=64, max_num_batched_tokens=2048, num_blocks=30000,
            enable_prefix_caching=prefix)))
        res = simulate(cluster, CFG, HW, reqs)
        replica = res.replicas[0]
        cached[prefix] = replica.busy_s
        hit_rate[prefix] = summarize(res, SLO(10.0, 1.0), 1.0)["prefix_cache_hit_rate"]
    assert cached[True] < cached[False]  # shared 512-token blocks skip their prefill
    # The plan states the share: hits over the admissions' lookups, in whole 16-token blocks.
    replica = res.replicas[0]
    assert replica.prefix_cache_queries_tokens >= sum(r.prompt_len for r in reqs)
    assert replica.prefix_cache_hits_tokens % 16 == 0
    assert hit_rate[False] is None and 0 < hit_rate[True] < 1


def test_least_loaded_routing_balances_bursts() -> None:
    reqs = parse_workload("gamma:20:4,prompt=fixed:2000,output=fixed:50").generate(80, 5, 8192)
    p99 = {}
    for router in ("round_robin", "least_loaded"):
        cluster = ClusterConfig(colocated=PoolConfig(4, 1, _sched()), router=router)
        res = simulate(cluster, CFG, HW, reqs)
        busy = [r.busy_s for r in res.replicas]
        assert all(b > 0 for b in busy)
        p99[router] = percentile([r.ttft_s for r in res.records], 99)
    assert p99["least_loaded"] <= p99["round_robin"] * 1.05


def test_summary_metrics_and_costs() -> None:
    reqs = parse_workload("chat").with_rate(3).generate(50, 0, 8192)
    res = simulate(ClusterConfig(colocated=PoolConfig(1, 2, _sched())), CFG, HW, reqs)
    m = summarize(res, SLO(10.0, 1.0), HW.price_usd_per_hour)
    assert m["requests"] == 50 and m["gpus"] == 2 and m["meets_slo"] is True
    assert m["ttft"]["p50_s"] <= m["ttft"]["p90_s"] <= m["ttft"]["p99_s"]
    assert 0 < m["usd_per_million_input_tokens"] < m["usd_per_million_output_tokens"]
    strict = summarize(res, SLO(1e-6, 1e-6), HW.price_usd_per_hour)
    assert strict["slo_attainment"] == 0 and strict["meets_slo"] is False
    with pytest.raises(ValueError):
        SLO(0.0, 1.0)


def test_warmup_requests_run_but_are_not_measured() -> None:
    # Above this replica's capacity the queue grows all run: the first requests, into an
    # empty cluster, wait less than the ones after them.
    reqs = parse_workload("chat").with_rate(60).generate(240, 0, 8192)
    cluster = ClusterConfig(colocated=PoolConfig(1, 2, _sched()))
    cold = simulate(cluster, CFG, HW, reqs)
    warm = simulate(cluster, CFG, HW, reqs, warmup_requests=40)
    assert [r.index for r in cold.records] == [r.index for r in warm.records]  # same run
    assert cold.measured_records == cold.records and cold.window_start_s == 0.0
    measured = warm.measured_records
    assert sorted(r.index for r in measured) == list(range(40, 240))
    assert warm.window_start_s == reqs[40].arrival_s
    # Device time and replica totals count from that arrival on.
    assert warm.prefill_gpu_s + warm.decode_gpu_s == pytest.approx(
        2 * (warm.makespan_s - warm.window_start_s))
    (name,) = warm.window
    assert 0 < warm.window[name].busy_s < warm.replicas[0].busy_s
    assert cold.window[name].busy_s == cold.replicas[0].busy_s
    slo = SLO(2.0, 0.1)
    m_cold, m_warm = (summarize(r, slo, HW.price_usd_per_hour) for r in (cold, warm))
    print(f"from empty: {m_cold['slo_attainment']:.0%} inside, TTFT p50 "
          f"{m_cold['ttft']['p50_s']:.2f} s; after 40 warm-up requests: "
          f"{m_warm['slo_attainment']:.0%}, {m_warm['ttft']['p50_s']:.2f} s")
    assert (m_cold["requests"], m_warm["requests"]) == (240, 200)
    prompts = [r.prompt_len for r in reqs[40:]]  # the lengths stated are the measured ones'
    assert m_warm["prompt_tokens"]["max"] == max(prompts)
    assert m_warm["prompt_tokens"]["mean"] == pytest.approx(sum(prompts) / 200)
    assert m_cold["prompt_tokens"]["mean"] != pytest.approx(sum(prompts) / 200)
    assert m_warm["output_tokens"]["p90"] == percentile([r.output_len for r in reqs[40:]], 90)
    assert m_warm["ttft"]["p50_s"] > m_cold["ttft"]["p50_s"]
    assert m_warm["slo_attainment"] < m_cold["slo_attainment"]
    with pytest.raises(ValueError, match="none left to measure"):
        simulate(cluster, CFG, HW, reqs[:10], warmup_requests=10)


def test_the_prefix_hit_rate_counts_the_measured_admissions() -> None:
    reqs = parse_workload(f"trace:{SAMPLE}").with_rate(2).generate(40)
    cluster = ClusterConfig(colocated=PoolConfig(1, 1, SchedulerConfig(
        policy="chunked", max_num_seqs=64, max_num_batched_tokens=2048, num_blocks=30000,
        enable_prefix_caching=True)))
    res = simulate(cluster, CFG, HW, reqs, warmup_requests=10)
    (w,) = res.window.values()
    replica = res.replicas[0]
    assert 0 < w.prefix_cache_queries_tokens < replica.prefix_cache_queries_tokens
    assert summarize(res, SLO(10.0, 1.0), 1.0)["prefix_cache_hit_rate"] == (
        w.prefix_cache_hits_tokens / w.prefix_cache_queries_tokens)
