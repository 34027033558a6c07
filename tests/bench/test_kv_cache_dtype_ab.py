"""The K/V pool dtype bench runs on the tiny preset: every pool, decode and prefill."""

from __future__ import annotations

import json
import os
import re
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
    pools = {"float32": 4, "bfloat16": 2, "fp8": 1}  # the default pools and their bytes
    for r in doc["decode"]:
        lens = [40 + 2] * r["batch"]  # the median step's context
        for pool, kv_bytes in pools.items():
            assert r[pool]["bytes_per_step"] == decode_bytes(cfg, lens, 4, kv_dtype_bytes=kv_bytes)
            assert r["time_over_first"][pool] == pytest.approx(
                r[pool]["step_s"] / r["float32"]["step_s"])
    pre = doc["prefill"]
    assert pre["tokens"] == 32 and all(pre[p]["step_s"] > 0 for p in pools)
    assert re.search(r"batch +3 context +40: .* \| fp8 [\d.]+ ms [\d.]+ GB/s [\d.]+x", proc.stdout)
    assert "prefill 32: float32 pool" in proc.stdout
