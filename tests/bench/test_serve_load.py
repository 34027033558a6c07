"""The server load bench (issue 10): --quick sweeps levels 1 and 4 and writes every field."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUN_FIELDS = ("wall_s", "requests", "output_tokens", "req_per_s", "output_tok_per_s",
              "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s")


def test_serve_load_quick_writes_every_field(tmp_path: Path) -> None:
    out = tmp_path / "serve_load.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "serve_load.py"), "--quick",
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["bench"] == "serve_load" and doc["max_tokens"] == 8
    assert [r["level"] for r in doc["levels"]] == [1, 4]
    for row in doc["levels"]:
        srv, off = row["server"], row["offline"]
        for run in (srv, off):
            assert all(run[k] is not None for k in RUN_FIELDS), run
            assert run["requests"] == doc["requests_per_level"] == 8
            assert run["output_tokens"] == 8 * 8  # greedy with ignore_eos: every token counts
            assert 0 < run["ttft_p50_s"] <= run["ttft_p99_s"]
            assert 0 <= run["itl_p50_s"] <= run["itl_p99_s"]
        assert srv["errors"] == 0 and srv["not_started"] == 0
        assert srv["tokens_per_chunk"] >= 1
        assert row["throughput_ratio"] == srv["output_tok_per_s"] / off["output_tok_per_s"]
        assert row["overhead_frac"] == 1 - row["throughput_ratio"]
        assert row["text_match_frac"] == 1.0  # streamed greedy text equals offline's
    assert "srv/off" in proc.stdout and str(out) in proc.stdout
