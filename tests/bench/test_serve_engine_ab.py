"""The engine thread/process A/B bench: --quick runs both servers and offline, same texts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_serve_engine_ab_quick_compares_both_modes(tmp_path: Path) -> None:
    out = tmp_path / "ab.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "serve_engine_ab.py"), "--quick",
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert set(doc["summary"]) == {"engine thread", "engine process", "offline"}
    for name in ("engine thread", "engine process"):
        runs = doc["runs"][name]
        assert len(runs) == doc["rounds"] == 2
        assert all(r["output_tokens"] == 8 * 8 and r["errors"] == 0 for r in runs)
        assert doc["summary"][name]["best_over_offline"] > 0
    # The engine's CPU counts the core process too (not only the thread that talks to it).
    cpu = {name: doc["summary"][name]["engine_cpu_us_per_tok"]
           for name in ("engine thread", "engine process")}
    assert cpu["engine process"] > 0.5 * cpu["engine thread"] > 0
    assert doc["summary"]["offline"]["best_over_offline"] == 1.0
    assert "median/off" in proc.stdout and str(out) in proc.stdout
