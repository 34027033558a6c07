"""Workload specs, presets, traces and their errors."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from splitphase.sim.workload import (
    PRESETS,
    TraceRecord,
    WorkloadError,
    load_trace,
    parse_workload,
    spread_ties,
)

SAMPLE = Path(__file__).parent / "mooncake_sample.jsonl"


def test_poisson_rate_and_lengths() -> None:
    wl = parse_workload("poisson:4,prompt=uniform:10:20,output=fixed:7")
    reqs = wl.generate(2000, seed=1)
    span = reqs[-1].arrival_s - reqs[0].arrival_s
    assert len(reqs) / span == pytest.approx(4, rel=0.1)
    assert all(10 <= r.prompt_len <= 20 and r.output_len == 7 for r in reqs)


def test_gamma_is_burstier_than_poisson() -> None:
    def cv(spec: str) -> float:
        reqs = parse_workload(spec).generate(3000, seed=2)
        gaps = [b.arrival_s - a.arrival_s for a, b in zip(reqs, reqs[1:], strict=False)]
        return statistics.pstdev(gaps) / statistics.fmean(gaps)

    assert cv("poisson:2") == pytest.approx(1.0, abs=0.1)
    assert cv("gamma:2:3") > 2.0


def test_rate_change_keeps_lengths_and_scales_time() -> None:
    wl = PRESETS["chat"]
    a, b = wl.with_rate(1).generate(50, 3), wl.with_rate(4).generate(50, 3)
    assert [r.prompt_len for r in a] == [r.prompt_len for r in b]
    assert b[-1].arrival_s == pytest.approx(a[-1].arrival_s / 4)


def test_lognormal_median_and_clip() -> None:
    reqs = parse_workload("poisson:1,prompt=lognormal:1000:0.5").generate(3000, 0, max_len=1500)
    assert statistics.median(r.prompt_len for r in reqs) == pytest.approx(1000, rel=0.1)
    assert all(r.prompt_len + r.output_len <= 1500 for r in reqs)


def test_presets_and_options() -> None:
    assert set(PRESETS) == {"chat", "rag", "code", "summarization"}
    assert PRESETS["rag"].mean_prompt_len > 4 * PRESETS["chat"].mean_prompt_len
    assert parse_workload("rag,rate=3").rate_per_s == 3


def test_mooncake_trace_replay_scales_time_and_keeps_hashes() -> None:
    trace = load_trace(SAMPLE)
    assert len(trace) == 40 and trace[0].hash_ids[0] == 0
    wl = parse_workload(f"trace:{SAMPLE}").with_rate(10.0)
    reqs = wl.generate(40)
    assert (len(reqs) - 1) / reqs[-1].arrival_s == pytest.approx(10.0)
    assert reqs[3].prompt_len == trace[3].prompt_len and reqs[3].hash_ids == trace[3].hash_ids
    pairs = parse_workload(f"poisson:1,lengths=trace:{SAMPLE}").generate(20)
    assert {(r.prompt_len, r.output_len) for r in pairs} <= {
        (t.prompt_len, t.output_len) for t in trace}


def test_a_trace_replays_from_its_start_option() -> None:
    whole = parse_workload(f"trace:{SAMPLE}")
    later = parse_workload(f"trace:{SAMPLE},start=25")
    full, tail = whole.generate(40), later.generate(15)
    # The same requests from the 26th on, time measured from the first replayed one.
    assert [(r.prompt_len, r.output_len, r.hash_ids) for r in tail] == [
        (r.prompt_len, r.output_len, r.hash_ids) for r in full[25:]]
    assert [r.arrival_s for r in tail] == pytest.approx(
        [r.arrival_s - full[25].arrival_s for r in full[25:]])
    assert later.describe()["trace_start"] == 25 and later.describe()["trace_requests"] == 40
    assert later.name.endswith(",start=25") and whole.describe()["trace_start"] == 0
    with pytest.raises(WorkloadError, match="holds 40"):
        parse_workload(f"trace:{SAMPLE},start=40")
    for bad in ("start=-1", "start=x", "rate=2", "start"):
        with pytest.raises(WorkloadError, match="start=N"):
            parse_workload(f"trace:{SAMPLE},{bad}")


def test_requests_sharing_a_tick_arrive_inside_it() -> None:
    # Mooncake stamps arrivals in 3 s ticks: replayed as stamped, a tick is one burst.
    trace = load_trace(SAMPLE)
    ticks = sorted({r.timestamp_s for r in trace})
    assert len(ticks) < len(trace)
    resolution_s = min(b - a for a, b in zip(ticks, ticks[1:], strict=False))
    spread = spread_ties(trace)
    times = [r.timestamp_s for r in spread]
    assert times == sorted(times) and len(set(times)) == len(times)
    for old, new in zip(trace, spread, strict=True):  # same request, inside its own tick
        assert old.timestamp_s <= new.timestamp_s < old.timestamp_s + resolution_s
        assert (new.prompt_len, new.hash_ids) == (old.prompt_len, old.hash_ids)
    assert spread_ties(trace) == spread  # seeded: every plan replays the same arrivals
    wl = parse_workload(f"trace:{SAMPLE}")
    reqs = wl.with_rate(1.0).generate(40)
    assert len({r.arrival_s for r in reqs}) == 40
    described = wl.describe()  # the plan states the trace's own resolution
    assert described["trace_timestamps"] == len(ticks)
    assert described["trace_resolution_s"] == pytest.approx(resolution_s)
    # A trace of one timestamp states no spread; a lone request keeps its time.
    burst = (TraceRecord(0.0, 10, 5), TraceRecord(0.0, 20, 5))
    assert spread_ties(burst) == burst
    lone = (TraceRecord(0.0, 10, 5), TraceRecord(3.0, 20, 5), TraceRecord(3.0, 30, 5))
    assert spread_ties(lone)[0].timestamp_s == 0.0


@pytest.mark.parametrize("spec", [
    "nonsense", "poisson:-1", "poisson:0", "poisson:x", "gamma:1", "gamma:1:0",
    "poisson:1,prompt=uniform:5:1", "poisson:1,prompt=weibull:3", "poisson:1,foo=1",
    "chat,rate=-2", "trace:/nonexistent/file.jsonl",
])
def test_bad_specs_raise(spec: str) -> None:
    with pytest.raises(WorkloadError):
        parse_workload(spec)


def test_empty_and_malformed_traces(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(WorkloadError, match="no requests"):
        parse_workload(f"trace:{empty}")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_length": 0, "output_length": 3}\n')
    with pytest.raises(WorkloadError, match=">= 1"):
        load_trace(bad)
