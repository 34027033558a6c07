"""The prefill attention A/B bench runs on the tiny preset and reports both variants."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from splitphase.kernels import build

ROOT = Path(__file__).resolve().parents[2]


def test_prefill_attention_ab_reports_native_and_sdpa() -> None:
    if not build.available():
        pytest.skip(f"native kernels unavailable: {build.status().reason}")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "prefill_attention_ab.py"), "--preset", "tiny",
         "--lengths", "40", "--rounds", "1", "--clock", "process"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("n 40:"))
    assert "native" in line and "sdpa" in line and "sdpa/native" in line
