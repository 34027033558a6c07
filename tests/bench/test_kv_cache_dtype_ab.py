"""The K/V pool dtype bench runs on the tiny preset: both pools, decode and prefill."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from splitphase.audit.flops import decode_bytes
from splitphase.model.config import ModelConfig

ROOT = Path(__file__).resolve().parents[2]


def test_kv_cache_dtype_ab_times_both_pools(tmp_path: Path) -> None:
    out = tmp_path / "kv.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "kv_cache_dtype_ab.py"), "--preset", "tiny",
         "--batch", "1", "3", "--context", "40", "--steps", "4", "--rounds", "1",
         "--prefill", "32", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert [(r["batch"], r["context"]) for r in doc["decode"]] == [(1, 40), (3, 40)]
    cfg = ModelConfig.from_name("tiny")
    for r in doc["decode"]:
        full, half = r["float32"], r["bfloat16"]
        lens = [40 + 2] * r["batch"]  # the median step's context
        assert full["bytes_per_step"] == decode_bytes(cfg, lens, 4)
        assert half["bytes_per_step"] == decode_bytes(cfg, lens, 4, kv_dtype_bytes=2)
        assert r["bf16_over_fp32_time"] == pytest.approx(half["step_s"] / full["step_s"])
    assert doc["prefill"]["tokens"] == 32 and doc["prefill"]["bfloat16"]["step_s"] > 0
    assert "bf16/fp32" in proc.stdout and "prefill 32: fp32 pool" in proc.stdout
