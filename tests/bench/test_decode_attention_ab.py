"""The decode attention bench runs on the tiny preset and reports the kernel and the stream."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from splitphase.kernels import build

ROOT = Path(__file__).resolve().parents[2]


def test_decode_attention_ab_reports_native_and_stream() -> None:
    if not build.available():
        pytest.skip(f"native kernels unavailable: {build.status().reason}")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        # context 20 pads to two blocks of 16 or one of 32: the stream reads more than it holds
        [sys.executable, str(ROOT / "bench" / "decode_attention_ab.py"), "--preset", "tiny",
         "--batch", "1", "3", "--context", "20", "--rounds", "1", "--block", "16", "32"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = [x for x in proc.stdout.splitlines() if x.startswith(("b1 context 20 ", "b3 "))]
    assert [x.split(":")[0] for x in lines] == [
        f"b{b} context 20 block {k}" for b in (1, 3) for k in (16, 32)]
    assert all("native" in x and "stream" in x and "of the stream's GB/s" in x for x in lines)
    assert all("cached" in x and "x cached's time" in x for x in lines)


def test_decode_attention_ab_times_fp32_queries_over_an_fp8_pool() -> None:
    if not build.available():
        pytest.skip(f"native kernels unavailable: {build.status().reason}")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "decode_attention_ab.py"), "--preset", "tiny",
         "--batch", "2", "--context", "32", "--rounds", "1", "--pool", "fp8"],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "float32 queries over torch.float8_e4m3fn pools" in proc.stdout
    assert any(x.startswith("b2 context 32 block 16: native") for x in proc.stdout.splitlines())
