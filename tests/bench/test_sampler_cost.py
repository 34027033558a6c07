"""bench/sampler_cost.py runs and prints a row per SamplingParams and both side-by-side pieces."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_sampler_cost_prints_every_row_and_both_ratios() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "sampler_cost.py"), "--preset", "tiny",
         "--rows", "1", "3", "--repeats", "1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    for row in ("greedy", "temp 0.8, top_p 0.9", "temperature 1, logprobs 5"):
        line = next(x for x in out.splitlines() if x.startswith(row))
        assert len(line.split()[-2:]) == 2 and all(float(v) > 0 for v in line.split()[-2:])
    for piece in ("greedy argmax of 3 rows:", "draw (a row):", "top-p sort (a row):"):
        assert piece in out and "torch's" in out.split(piece)[1].splitlines()[0]
