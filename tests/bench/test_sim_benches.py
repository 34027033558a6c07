"""The simulator benches (issue 6): validation against the real engine, reduced for CI, and the
scale bench's quick grid (timing is printed, never asserted)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _run(script: str, out: Path, timeout_s: int) -> dict:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--quick", "--out",
                           str(out)], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=timeout_s)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.serial  # under the other pytest worker's load one row's mean error reached 1.08
def test_simulated_latencies_track_the_real_engine(tmp_path: Path) -> None:
    # The cost model is fitted to the steps of these same runs (in-run calibration), so the
    # machine's load at the time is in both; 12 requests on a shared 2-core machine are noisy,
    # hence looser bounds than the bench's 20% (the README table has the full run). The worst
    # error is bounded on the means: a p50 of 12 TPOTs can sit between the decodes that
    # waited on another request's prefill and those that did not, and jump between the two
    # (on the AMD Zen 3 host, four runs' worst p50 errors were 0.13-0.64, the worst mean
    # errors 0.32-0.40, their medians 0.06-0.13). Larger errors (a mean 1.11 off in CI, up to
    # 2.7 here) came from a bug, not noise: the replay re-ran `calibrate`, whose cached peaks
    # a spot probe can find stale and re-measure, so the fitted fractions met other peaks.
    doc = _run("sim_validate.py", tmp_path / "v.json", 300)
    rows = doc["rows"]
    assert {(r["workload"], r["policy"]) for r in rows} == {
        (w, p) for w in ("short", "long") for p in ("mixed", "chunked")}
    p50_errors = [r[f"{k}_error"] for r in rows for k in ("ttft_s", "tpot_s")]
    mean_errors = [r[f"{k}_mean_error"] for r in rows for k in ("ttft_s", "tpot_s")]
    assert max(mean_errors) < 1.0, rows
    assert statistics.median(mean_errors) < 0.25, rows
    assert statistics.median(p50_errors) < 0.3, rows
    for r in rows:  # the long workload's prompts cost more time to first token, in both
        if r["workload"] == "long":
            short = next(x for x in rows if x["workload"] == "short" and
                         x["policy"] == r["policy"])
            assert r["simulated_ttft_s_p50"] > 2 * short["simulated_ttft_s_p50"]
            assert r["measured_ttft_s_p50"] > 2 * short["measured_ttft_s_p50"]


def test_scale_bench_quick_grid(tmp_path: Path) -> None:
    doc = _run("sim_scale.py", tmp_path / "s.json", 300)
    assert [(r["requests"], r["replicas"]) for r in doc["rows"]] == [(500, 1), (1000, 2),
                                                                      (2000, 4)]
    for r in doc["rows"]:
        assert r["sim_requests_per_wall_s"] > 0 and r["steps"] > 0 and r["output_tokens"] > 0
