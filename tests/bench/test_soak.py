"""The soak bench: --quick runs a mixed open-loop load on a tiny model and loses nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_soak_quick_prints_the_table_and_records_the_run(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "soak.py"), "--quick",
                           "--ledger", str(ledger)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for kind in ("stream", "plain", "disconnect", "timeout", "hostile"):
        assert f"\n{kind}" in proc.stdout
    assert "requests lost: 0" in proc.stdout and "TTFT p50/p99" in proc.stdout
    (case,) = json.loads(ledger.read_text())["cases"]
    assert case["group"] == "load" and case["lost"] == 0 and case["held"] > 0
