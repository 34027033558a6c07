"""The cost model: roofline parts, tensor parallelism, KV capacity and transfer, calibration."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from splitphase.audit.flops import attention_cost, step_cost
from splitphase.hardware.specs import LINKS, get_hardware, get_link
from splitphase.model.config import ModelConfig
from splitphase.sim.calibrate import StepSample, fit_efficiency, prediction_error
from splitphase.sim.cost_model import CostModel, CostModelError, Efficiency
from splitphase.sim.step_work import step_work

CFG = ModelConfig.from_name("llama-3.1-8b")
H100 = get_hardware("h100-sxm")


def test_decode_is_bandwidth_bound_and_grows_with_context() -> None:
    eff = Efficiency(1.0, 1.0, 0.0, 0.0, 0.0)
    cm = CostModel(CFG, H100, efficiency=eff)
    one = cm.step_time([], [1000]).total_s
    cost = step_cost(CFG, [], [1000])
    assert one == pytest.approx(cost.bytes / H100.mem_bandwidth_bytes_per_s, rel=0.01)
    assert cm.step_time([], [8000] * 32).total_s > 3 * one


def test_prefill_is_compute_bound_and_dense_plus_attention_add() -> None:
    eff = Efficiency(1.0, 1.0, 0.0, 0.0, 0.0)
    cm = CostModel(CFG, H100, efficiency=eff)
    chunks = [(4096, 0)]
    total, attn = step_cost(CFG, chunks, []), attention_cost(CFG, chunks, [])
    peak = H100.peak_flops_per_s()
    expect = (total.flops - attn.flops) / peak + max(
        attn.flops / peak, attn.bytes / H100.mem_bandwidth_bytes_per_s)
    assert cm.step_time(chunks, []).total_s == pytest.approx(expect)
    # A decode batch riding on a prefill chunk pays its KV reads on top (interference).
    small = [(512, 0)]
    alone = cm.step_time(small, []).total_s
    kv_s = 16 * 6000 * cm.kv_bytes_per_token() / H100.mem_bandwidth_bytes_per_s
    assert cm.step_time(small, [6000] * 16).total_s == pytest.approx(alone + kv_s, rel=0.05)


def test_small_gemms_run_below_the_large_batch_rate() -> None:
    cm = CostModel(CFG, H100, efficiency=Efficiency(0.5, 0.6, 0.0, 0.0, 128.0))
    per_token_small = cm.step_time([(256, 0)], []).total_s / 256
    per_token_large = cm.step_time([(2048, 0)], []).total_s / 2048
    assert per_token_small > 1.25 * per_token_large


def test_tensor_parallelism_splits_work_and_adds_allreduce() -> None:
    eff = Efficiency(0.5, 0.6, 0.0, 0.0, 0.0)
    t1 = CostModel(CFG, H100, 1, eff).step_time([(4096, 0)], []).total_s
    cm2 = CostModel(CFG, H100, 2, eff)
    t2 = cm2.step_time([(4096, 0)], []).total_s
    assert cm2.allreduce_s(4096) > 0
    assert t2 == pytest.approx(t1 / 2 + cm2.allreduce_s(4096), rel=1e-6)
    with pytest.raises(CostModelError):
        CostModel(CFG, H100, 3)
    with pytest.raises(CostModelError):
        CostModel(CFG, get_hardware("l4"), 2)  # no interconnect in the table


def test_kv_capacity_and_transfer() -> None:
    cm = CostModel(CFG, H100)
    blocks = cm.num_kv_blocks(16)
    kv_bytes = blocks * 16 * cm.kv_bytes_per_token()
    assert kv_bytes == pytest.approx(80e9 * 0.9 - cm.weight_bytes, rel=0.01)
    with pytest.raises(CostModelError, match="does not fit"):
        CostModel(ModelConfig.from_name("llama-3.1-70b"), H100).num_kv_blocks(16)
    nv, ib = get_link("nvlink"), get_link("infiniband")
    assert cm.kv_transfer_s(8000, ib) > 5 * cm.kv_transfer_s(8000, nv)
    assert set(LINKS) == {"nvlink", "infiniband", "ethernet"}


def test_an_fp8_kv_cache_fits_twice_the_tokens_and_moves_half_the_kv() -> None:
    bf16, fp8 = CostModel(CFG, H100), CostModel(CFG, H100, kv_dtype_bytes=1)
    assert fp8.kv_bytes_per_token() * 2 == bf16.kv_bytes_per_token()
    assert fp8.num_kv_blocks(16) in (2 * bf16.num_kv_blocks(16), 2 * bf16.num_kv_blocks(16) + 1)
    ib = get_link("infiniband")
    assert fp8.kv_transfer_s(8000, ib) < bf16.kv_transfer_s(8000, ib)
    assert fp8.weight_bytes == bf16.weight_bytes  # weights stay bf16
    long_ctx, short_ctx = [8000] * 32, [100] * 32
    saved_long = bf16.step_time([], long_ctx).total_s - fp8.step_time([], long_ctx).total_s
    saved_short = bf16.step_time([], short_ctx).total_s - fp8.step_time([], short_ctx).total_s
    assert saved_long > 20 * saved_short > 0  # the K/V share of a decode step halves


def test_fp8_weights_take_half_the_memory_and_multiply_at_the_fp8_peak() -> None:
    bf16 = CostModel(CFG, H100)
    fp8 = CostModel(CFG, H100, dtype="float8", weight_bytes_per_param=1.0)
    assert fp8.weight_bytes * 2 == bf16.weight_bytes
    assert fp8.kv_bytes_per_token() == bf16.kv_bytes_per_token()  # the cache stays bf16
    assert fp8.num_kv_blocks(16) > bf16.num_kv_blocks(16)  # the memory the weights free
    decode = [1000] * 8  # memory-bound: about half the bytes
    assert fp8.step_time([], decode).total_s < 0.7 * bf16.step_time([], decode).total_s
    prefill = [(4096, 0)]  # compute-bound: the FP8 peak is twice bf16's on an H100
    assert fp8.step_time(prefill, []).total_s < 0.7 * bf16.step_time(prefill, []).total_s
    assert fp8.allreduce_s(512) == bf16.allreduce_s(512)  # activations stay bf16
    # The closed form counts the same bytes as the general formulas at any weight width.
    int4 = CostModel(CFG, H100, weight_bytes_per_param=0.515625)
    assert int4.step_time([(300, 0)], decode) == int4._time_of(
        step_work(CFG, [(300, 0)], decode, 0.515625, 2))


def test_efficiency_from_audit_report(tmp_path: Path) -> None:
    p = tmp_path / "report.json"
    p.write_text(json.dumps({"prefill": {"flops_utilization": 0.41},
                             "decode": {"bandwidth_utilization": 0.73}}))
    eff = Efficiency.from_audit_report(tmp_path)
    assert (eff.flops_fraction, eff.bandwidth_fraction) == (0.41, 0.73)
    assert "K/V" not in eff.source  # an older report: the width is not stated
    p.write_text(json.dumps({"prefill": {"flops_utilization": 0.41}, "model": {
        "kv_dtype_bytes": 1}, "decode": {"bandwidth_utilization": 0.73}}))
    assert Efficiency.from_audit_report(p).source.endswith("with 1-byte K/V elements)")
    p.write_text(json.dumps({"prefill": {"flops_utilization": 0.41}, "model": {
        "kv_dtype_bytes": 2, "weight_format": "fp8"}, "decode": {"bandwidth_utilization": 0.73}}))
    assert Efficiency.from_audit_report(p).source.endswith(
        "with 2-byte K/V elements and fp8 weights)")
    p.write_text("{}")
    with pytest.raises(CostModelError):
        Efficiency.from_audit_report(p)


def test_fit_recovers_step_times_it_was_given() -> None:
    cfg, hw = ModelConfig.from_name("small"), get_hardware("h100-sxm")
    eff_true = Efficiency(0.2, 0.4, 2e-3, 1e-4, 64.0, prefill_step_overhead_s=3e-3)
    truth = CostModel(cfg, hw, efficiency=eff_true, dtype="float32", dtype_bytes=4)
    shapes = [((n, 0),) for n in (16, 64, 256, 512)] + [()] * 4
    ctxs = [(), (), (), (), (100,), (200,) * 4, (300,) * 8, (50,) * 16]
    samples = [StepSample(c, d, truth.step_time(c, d).total_s)
               for c, d in zip(shapes, ctxs, strict=True)]
    eff = fit_efficiency(cfg, hw, samples)
    fitted = CostModel(cfg, hw, efficiency=eff, dtype="float32", dtype_bytes=4)
    assert prediction_error(fitted, samples) < 0.05
    assert eff.prefill_step_overhead_s == pytest.approx(3e-3, rel=0.1)


def test_prefill_step_overhead_applies_only_to_steps_with_prompt_tokens() -> None:
    cfg, hw = ModelConfig.from_name("small"), get_hardware("h100-sxm")
    base = Efficiency(0.5, 0.6, 1e-3, 0.0, 0.0)
    extra = dataclasses.replace(base, prefill_step_overhead_s=4e-3)
    a, b = (CostModel(cfg, hw, efficiency=e, dtype="float32", dtype_bytes=4) for e in (base, extra))
    assert b.step_time((), (100, 200)).total_s == a.step_time((), (100, 200)).total_s
    diff = b.step_time(((64, 0),), (100,)).total_s - a.step_time(((64, 0),), (100,)).total_s
    assert diff == pytest.approx(4e-3)
    with pytest.raises(CostModelError):
        dataclasses.replace(base, prefill_step_overhead_s=-1.0)
