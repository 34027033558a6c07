"""bench/gpu_check.sh, the one command for a lent GPU, runs every step (here on the CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_on_cpu_runs_every_step_and_writes_the_json(tmp_path: Path) -> None:
    env = {**os.environ, "DEVICE": "cpu", "QUICK": "1", "OUT_DIR": str(tmp_path),
           "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    for name in ("env", "gpu_tests", "phase_limits"):
        assert f"== {name}: exit 0" in proc.stdout
        assert (tmp_path / f"{name}.log").stat().st_size > 0
    assert "needs a CUDA device" in (tmp_path / "gpu_tests.log").read_text()  # skipped, listed
    data = json.loads((tmp_path / "phase_limits_cpu.json").read_text())
    assert data["device"] == "cpu" and data["quick"] is True


def test_a_failing_step_fails_the_run_after_the_others_ran(tmp_path: Path) -> None:
    env = {**os.environ, "DEVICE": "no-such-device", "OUT_DIR": str(tmp_path),
           "PYTHON": sys.executable}
    env.pop("OUT", None)
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert "== gpu_tests: exit 0" in proc.stdout and "failed: phase_limits" in proc.stdout
