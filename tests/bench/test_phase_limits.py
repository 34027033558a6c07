"""bench/phase_limits.py --quick runs on the tiny preset and writes every field the issue names."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from splitphase.hardware import cpuinfo
from splitphase.kernels import packed_linear

ROOT = Path(__file__).resolve().parents[2]
REQUIRED = [
    "decode_bw_fraction_b1",
    "decode_bw_fraction_b1_interleaved",
    "decode_read_fraction_b1_interleaved",
    "decode_bw_fraction_b8",
    "prefill_flops_fraction_512",
    "prefill_gemm_ceiling_fraction_512",
    "prefill_flops_fraction_512_interleaved",
    "speedup_vs_transformers_decode_b1",
    "speedup_vs_transformers_prefill_512",
    "speedup_vs_llamacpp_decode_b1",
    "speedup_vs_llamacpp_decode_b1_interleaved",
    "continuous_batching_speedup",
    "threads",
]


def test_quick_run_writes_every_field(tmp_path: Path) -> None:
    out = tmp_path / "phase_limits.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "phase_limits.py"), "--quick", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    data = json.loads(out.read_text())
    for key in REQUIRED:
        assert key in data, key
    assert data["threads"] == 1 and data["preset"] == "tiny"
    bf16_gemm = data["packed_prefill_gemm_bfloat16"]  # which GEMM bf16 prefill linears took
    if packed_linear.backends() and not cpuinfo.cpu_has_bf16_instructions():
        assert bf16_gemm.endswith(", widened to fp32")  # oneDNN's would be emulated
    assert data["gemm_forms"] == {}  # the tiny model's products are too small to be timed
    peaks = data["peaks"]
    assert peaks["triad_bytes_per_s"] > 0
    assert peaks["matmul_model_shapes_flops_per_s_float32"] > 0
    for name in ("float32", "bfloat16"):
        ours = data["dtypes"][name]["ours"]
        for batch in (1, 8):
            d = ours[f"decode_b{batch}"]
            assert d["tok_per_s"] > 0 and d["bw_fraction"] > 0
            assert d["bandwidth_bytes_per_s"] == d["bytes_per_step"] / d["step_s"]
        assert ours["prefill_64"]["flops_fraction"] > 0
        paired = ours["interleaved_prefill_64_gemm"]  # the prefill and a GEMM in alternation
        assert paired["flops_fraction"] == pytest.approx(
            ours["prefill_64"]["flops"] / paired["prefill_s"]
            / (paired["gemm_flops"] / paired["gemm_s"])
        )
        assert 0 < ours["prefill_64"]["gemm_ceiling_fraction"] <= 1 + 1e-9  # shape <= peak
        assert ours["decode_overhead_fraction_b1"] > 0
        paired = ours["interleaved_b1_triad"]  # the step and a triad pass in alternation
        assert paired["bw_fraction"] == pytest.approx(
            ours["decode_b1"]["bytes_per_step"] / paired["step_s"] / paired["triad_bytes_per_s"]
        )
        assert paired["read_fraction"] == pytest.approx(  # and a read-only pass
            ours["decode_b1"]["bytes_per_step"] / paired["step_s"]
            / (paired["read_bytes_per_pass"] / paired["read_pass_s"])
        )
    assert data["speedup_vs_transformers_decode_b1"] > 0  # transformers is a dev dependency
    # llama.cpp is optional (`make bench`): a ratio when installed, else a stated reason.
    llama = data["dtypes"]["float32"]["baselines"]["llamacpp"]
    if data["speedup_vs_llamacpp_decode_b1"] is None:
        assert isinstance(llama, str) and "llama-cpp-python" in llama
        assert "llamacpp: llama-cpp-python is not installed" in proc.stdout
        assert data["speedup_vs_llamacpp_decode_b1_interleaved"] is None
    else:
        assert llama["decode_step_s_b1"] > 0
        ratio = llama["decode_step_s_b1_interleaved"] / llama["ours_decode_step_s_b1_interleaved"]
        assert data["speedup_vs_llamacpp_decode_b1_interleaved"] == pytest.approx(ratio)
    b = data["batching"]  # the speedup, and the ceiling the fp32 matmul peak puts on it
    assert (b["dtype"], b["prompt_len"], b["output_len"]) == ("float32", 8, 8)
    assert b["flop_bound_speedup"] == pytest.approx(
        b["flop_bound_tok_per_s_concurrent"] / b["engine_tok_per_s_1"])
    assert b["concurrent_peak_fraction"] == pytest.approx(
        b["engine_tok_per_s_concurrent"] / b["flop_bound_tok_per_s_concurrent"])
    assert data["continuous_batching_flop_bound_speedup"] == b["flop_bound_speedup"]
    assert data["continuous_batching_decode_speedup"] == pytest.approx(  # the decode steps alone
        b["engine_decode_tok_per_s_concurrent"] / b["engine_decode_tok_per_s_1"])
    assert 0 < b["prefill_time_fraction_concurrent"] < 1
    assert "its decode steps alone" in proc.stdout
    assert "dec b1 tok/s" in proc.stdout and f"wrote {out}" in proc.stdout
    assert "the matmul peak's bound" in proc.stdout


@pytest.mark.slow
def test_quick_run_with_compile_adds_its_rows(tmp_path: Path) -> None:
    out = tmp_path / "phase_limits.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "bench" / "phase_limits.py"), "--quick", "--compile",
           "--dtypes", "float32", "--skip-hf", "--skip-llamacpp", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 and "InductorError" in proc.stderr:
        pytest.skip("torch.compile (inductor) cannot compile on this machine")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    data = json.loads(out.read_text())
    ours, ratios = data["dtypes"]["float32"]["ours"], data["dtypes"]["float32"]["ratios"]
    assert ours["compile_first_calls_s"] > 0
    for key in ("decode_b1", "decode_b8", "prefill_64"):
        assert ratios[f"compile_speedup_{key}"] > 0
        assert ours[f"{key}_compiled"]["flops" if key.startswith("prefill") else "bytes_per_step"]
    assert "torch.compile: decode b1" in proc.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_quick_run_on_cuda_measures_bf16_against_measured_and_datasheet_peaks(
        tmp_path: Path) -> None:
    out = tmp_path / "phase_limits.json"
    cmd = [sys.executable, str(ROOT / "bench" / "phase_limits.py"), "--quick", "--device", "cuda",
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    data = json.loads(out.read_text())
    for key in REQUIRED:
        assert key in data, key
    assert data["device"] == "cuda" and data["primary_dtype"] == "bfloat16"
    peaks = data["peaks"]
    assert peaks["triad_bytes_per_s"] > 0 and peaks["matmul_model_shapes_flops_per_s_bfloat16"] > 0
    if any(n in torch.cuda.get_device_name().replace(" ", "").lower() for n in ("h100", "h200")):
        assert peaks["datasheet_bandwidth_bytes_per_s"] > 0
    ours = data["dtypes"]["bfloat16"]["ours"]
    assert ours["decode_b1"]["bw_fraction"] > 0 and ours["prefill_64"]["flops_fraction"] > 0
    assert data["speedup_vs_transformers_decode_b1"] > 0  # transformers on the same GPU
    assert data["speedup_vs_llamacpp_decode_b1"] is None  # llama.cpp is timed on CPU only
