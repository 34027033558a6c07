"""bench/packed_gemm.py and bench/decode_vs_llamacpp.py run on the tiny preset."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from splitphase.kernels import packed_gemms, packed_linear
from splitphase.perf.llamacpp_baseline import llama_cpp_module

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "bench" / script), "--preset", "tiny", *args],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)


def test_packed_gemm_prints_a_rate_per_shape_and_backend() -> None:
    proc = _run("packed_gemm.py", "--rows", "32", "--repeats", "3")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.lstrip().startswith("32 ")]
    assert len(rows) == 5  # tiny's distinct weight shapes, the head included
    names = [n for n in packed_linear.backends() if packed_gemms.takes(n, torch.float32)]
    assert all(len(r) == 3 + len(names) and all(float(v) > 0 for v in r[2:]) for r in rows)


def test_decode_vs_llamacpp_interleaves_or_says_what_is_missing() -> None:
    proc = _run("decode_vs_llamacpp.py", "--context", "16", "--rounds", "1", "--burst", "1")
    if llama_cpp_module()[0] is None:
        assert proc.returncode != 0 and "llama-cpp-python is not installed" in proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "llama.cpp's speed" in proc.stdout and "its linears alone" in proc.stdout


def test_decode_ab_times_every_variant_past_the_hand_over() -> None:
    rows = str(packed_linear.ONEDNN_MIN_ROWS + 1)
    proc = _run("decode_ab.py", "--batch", rows, "--context", "16", "--steps", "2",
                "--variants", "kernel_max", "fused", "per_op", "torch")
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith(f"float32 b{rows}:"))
    assert all(f"{v} best" in line for v in ("kernel_max", "fused", "per_op", "torch"))


def test_prefill_benches_time_the_passes_the_model_calls() -> None:
    proc = _run("prefill_ab.py", "--lengths", "64", "--rounds", "1",
                "--variants", "model", "fresh", "unfused")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "fresh" in proc.stdout and "unfused" in proc.stdout
    proc = _run("prefill_budget.py", "--lengths", "64", "--rounds", "1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    shares = {ln.split()[0]: float(ln.split()[-1].rstrip("%")) for ln in proc.stdout.splitlines()
              if ln.startswith("  ")}
    assert shares["silu_mul"] > 0 and shares["add_rms_norm"] > 0  # the in-place passes are seen
