"""The five audit steps on synthetic timings with known answers."""

from __future__ import annotations

import pytest

from splitphase.audit import flops as fl
from splitphase.audit.policies import PolicyResult
from splitphase.audit.steps import (
    ServingLimits,
    Workload,
    cost,
    profile,
    run_steps,
    utilization,
)
from splitphase.audit.steps.optimizations import (
    batching_policy,
    dual_flow_decode,
    interference,
    larger_decode_batch,
    moe_decode_top_k,
    narrower_kv_cache,
    optimizations,
    quantized_weights,
)
from splitphase.audit.steps.profile import percentile, union_length_s
from splitphase.audit.trace import RequestTrace
from splitphase.audit.weights import weight_format
from splitphase.errors import UserError
from splitphase.hardware.specs import HardwareSpec, get_hardware
from splitphase.model.config import ModelConfig

LLAMA8B = ModelConfig.from_name("llama-3.1-8b")
# Round peaks so expected utilizations are easy to state.
HW = HardwareSpec("test", peak_bf16_flops_per_s=1e15, mem_bandwidth_bytes_per_s=1e12,
                  mem_capacity_bytes=80e9, price_usd_per_hour=3.6, source="synthetic")
PREFILL_BASE_S, PREFILL_PER_TOKEN_S, ITL_S = 0.01, 1e-4, 0.02


def _trace(prompt: int, out: int = 9, start: float = 0.0, conc: int = 1, point: str = "",
           itl: float = ITL_S, prefill_s: float | None = None) -> RequestTrace:
    ttft = PREFILL_BASE_S + PREFILL_PER_TOKEN_S * prompt if prefill_s is None else prefill_s
    first = start + ttft
    times = [first + i * itl for i in range(out)]
    return RequestTrace(prompt, out, start, first, times, times[-1],
                        point=point or f"len={prompt} c={conc}", concurrency=conc)


def _sweep() -> list[RequestTrace]:
    traces, t = [], 0.0
    for n in (128, 512, 2048):
        for _ in range(2):
            traces.append(_trace(n, start=t))
            t += 10.0  # sequential: no overlap between requests
    return traces


def test_percentiles_and_union() -> None:
    assert percentile([1, 2, 3, 4, 5], 50) == 3
    assert percentile([0.0, 10.0], 90) == pytest.approx(9.0)
    assert union_length_s([(0, 2), (1, 3), (5, 6)]) == pytest.approx(4.0)


def test_profile_recovers_ttft_slope_and_itl() -> None:
    prof = profile(_sweep())
    assert prof.ttft_slope_s_per_token == pytest.approx(PREFILL_PER_TOKEN_S)
    assert prof.ttft_intercept_s == pytest.approx(PREFILL_BASE_S)
    assert prof.ttft_fit_r2 == pytest.approx(1.0)
    assert prof.itl.p50_s == pytest.approx(ITL_S)
    assert prof.source == "client" and prof.n_errors == 0
    assert {p.point for p in prof.points} == {"len=128 c=1", "len=512 c=1", "len=2048 c=1"}


def test_server_side_phase_times_are_preferred() -> None:
    t = _trace(512)
    t.server_queue_s, t.server_prefill_s, t.server_itl_s = 0.001, 0.03, 0.015
    prof = profile([t])
    assert prof.source == "server"
    assert prof.points[0].prefill.p50_s == pytest.approx(0.03)
    assert prof.points[0].decode_step_s == pytest.approx(0.015)
    q = _trace(512)
    q.server_queue_s = 0.02  # no prefill histogram: TTFT minus queue
    assert q.prefill_s() == pytest.approx(PREFILL_BASE_S + PREFILL_PER_TOKEN_S * 512 - 0.02)


def test_utilization_matches_hand_computation() -> None:
    util = utilization(profile(_sweep()), LLAMA8B, HW)
    pre = next(lv for lv in util.prefill.levels if lv.point == "len=2048 c=1")
    ttft = PREFILL_BASE_S + PREFILL_PER_TOKEN_S * 2048
    assert pre.flops_utilization == pytest.approx(fl.prefill_flops(LLAMA8B, 2048) / ttft / 1e15)
    assert pre.tokens_per_s == pytest.approx(2048 / ttft)
    dec = next(lv for lv in util.decode.levels if lv.point == "len=128 c=1")
    # Mean cached context during decode: prompt + tokens by the middle of each gap.
    ctx = round(dec.context_tokens)
    assert 128 < ctx < 128 + 9
    expected = fl.decode_bytes(LLAMA8B, [ctx], dtype_bytes=2) / ITL_S / 1e12
    assert dec.bandwidth_utilization == pytest.approx(expected)
    assert dec.tokens_per_s == pytest.approx(1 / ITL_S)
    assert dec.tokens_per_s_at_full == pytest.approx(dec.tokens_per_s / dec.utilization)
    assert util.decode.gap == (util.decode.headline.utilization < 0.5)


def test_batched_decode_counts_every_stream() -> None:
    batch = [_trace(512, conc=4, point="len=512 c=4") for _ in range(4)]  # in lockstep
    util = utilization(profile(batch), LLAMA8B, HW)
    dec = util.decode.levels[0]
    assert dec.batch == 4 and dec.tokens_per_s == pytest.approx(4 / ITL_S)
    ctx = round(dec.context_tokens)
    assert dec.bytes == pytest.approx(fl.decode_bytes(LLAMA8B, [ctx] * 4))
    pre = util.prefill.levels[0]  # four prompts prefilled in one interval
    ttft = PREFILL_BASE_S + PREFILL_PER_TOKEN_S * 512
    assert pre.seconds == pytest.approx(ttft)
    assert pre.flops == pytest.approx(4 * fl.prefill_flops(LLAMA8B, 512))


@pytest.mark.parametrize("gpu", ["h100-sxm", "a100-80gb", "l4", "mi300x"])
def test_bottleneck_decode_memory_prefill_compute(gpu: str) -> None:
    result = run_steps(_sweep(), LLAMA8B, get_hardware(gpu), 2.0, Workload(1000, 512, 64))
    assert result.bottleneck["decode"].bound == "memory"
    assert result.bottleneck["prefill"].bound == "compute"  # headline: the 2048-token prompts


def test_cost_math() -> None:
    util = utilization(profile(_sweep()), LLAMA8B, HW)
    work = Workload(requests_per_day=1000, prompt_tokens=2048, output_tokens=100)
    c = cost(util, 3.6, work, achievable_prefill=0.6, achievable_decode=0.8)
    pre_tps, dec_tps = util.prefill.headline.tokens_per_s, util.decode.headline.tokens_per_s
    assert c.now.usd_per_million_input_tokens == pytest.approx(3.6 / 3600 / pre_tps * 1e6)
    assert c.now.usd_per_million_output_tokens == pytest.approx(3.6 / 3600 / dec_tps * 1e6)
    busy_s = 1000 * (2048 / pre_tps + 100 / dec_tps) * 30
    assert c.now.monthly_usd == pytest.approx(busy_s / 3600 * 3.6)
    assert c.achievable.decode_tokens_per_s == pytest.approx(
        max(dec_tps, util.decode.headline.tokens_per_s_at_full * 0.8))
    assert c.monthly_savings_usd == pytest.approx(c.now.monthly_usd - c.achievable.monthly_usd)
    assert c.monthly_savings_usd >= 0 and c.assumptions
    with pytest.raises(UserError):
        cost(util, -1.0, work)


def test_zero_length_timings_are_user_errors() -> None:
    instant = RequestTrace(64, 4, 1.0, 1.0, [1.0, 1.1, 1.2, 1.3], 1.3, point="p")
    with pytest.raises(UserError, match="prefill time is zero"):
        profile([instant])
    one_chunk = RequestTrace(64, 4, 1.0, 1.2, [1.2], 1.2, point="p")
    with pytest.raises(UserError, match="no inter-token gaps"):
        profile([one_chunk])
    failed = RequestTrace(64, 0, 1.0, error="HTTP 500")
    with pytest.raises(UserError, match="every probe request failed"):
        profile([failed])


def _interference_profile():
    streams = [_trace(32, out=60, conc=6, point="interference") for _ in range(4)]
    for s in streams:
        s.role = "stream"
        # A 0.2 s stall between tokens 30 and 31, while the long prompt below is prefilled.
        s.token_times_s = [t + (0.2 if i > 30 else 0.0) for i, t in enumerate(s.token_times_s)]
        s.end_s = s.token_times_s[-1]
    stall_start = streams[0].token_times_s[30]
    inject = RequestTrace(2048, 2, stall_start, stall_start + 0.2,
                          [stall_start + 0.2, stall_start + 0.22], stall_start + 0.22,
                          point="interference", role="inject", concurrency=6)
    return profile(_sweep() + streams + [inject])


def test_interference_spike_is_measured() -> None:
    prof = _interference_profile()
    assert prof.interference is not None
    assert prof.interference.baseline_itl_s == pytest.approx(ITL_S)
    assert prof.interference.max_itl_s == pytest.approx(0.2 + ITL_S)
    assert prof.interference.spike > 1.5
    util = utilization(prof, LLAMA8B, HW)
    batched = interference(prof, util)
    assert batched.applicable and "chunked prefill (Sarathi-Serve)" in batched.detail
    # A target that states it is disaggregated already splits the batches: what stalls it is
    # hardware its workers share.
    split = interference(prof, util, "disaggregated")
    assert split.applicable and (split.before, split.after) == (batched.before, batched.after)
    assert "worker of its own" in split.detail and "Sarathi" not in split.detail
    row = next(o for o in optimizations(prof, util, LLAMA8B, HW, (), "disaggregated")
               if o.name == "isolate prefill from decode")
    assert row.detail == split.detail


def test_projected_optimizations_use_the_cost_model() -> None:
    util = utilization(profile(_sweep()), LLAMA8B, HW)
    quant = quantized_weights(util, LLAMA8B, HW)
    assert quant.applicable and 1.5 < (quant.speedup or 0) < 2.0  # weights halve, KV stays
    kv = narrower_kv_cache(util, LLAMA8B, HW)  # bf16 -> fp8 K/V, the weights stay
    lv = util.decode.headline
    ctx = [round(lv.context_tokens)] * max(1, round(lv.batch))
    narrow = fl.decode_bytes(LLAMA8B, ctx, 2, kv_dtype_bytes=1)
    full = fl.decode_bytes(LLAMA8B, ctx, 2)
    assert kv.applicable and kv.phase == "decode" and "fp8" in kv.detail
    assert 1.0 < (kv.speedup or 0) <= full / narrow + 1e-9  # at most the bytes' ratio
    dual = dual_flow_decode(util, LLAMA8B, HW)
    assert dual.applicable and dual.after is not None and dual.before is not None
    assert dual.after >= dual.before  # extra FLOPs are never free on the roofline
    assert dual.after / dual.before < 1.05  # but almost: decode is memory-bound
    assert not moe_decode_top_k(util, LLAMA8B, HW).applicable
    moe = ModelConfig.from_name("qwen3-30b-a3b")
    moe_util = utilization(profile(_sweep()), moe, HW)
    topk = moe_decode_top_k(moe_util, moe, HW)
    assert topk.applicable and (topk.speedup or 0) > 1.0


def test_a_narrower_kv_cache_is_priced_at_its_width() -> None:
    prof = profile(_sweep() + [_trace(512, conc=4, point="len=512 c=4") for _ in range(4)])
    full = utilization(prof, LLAMA8B, HW)
    fp8 = utilization(prof, LLAMA8B, HW, kv_dtype_bytes=1)
    assert full.kv_dtype_bytes == 2 and fp8.kv_dtype_bytes == 1
    for a, b in zip(full.decode.levels, fp8.decode.levels, strict=True):
        ctx = [round(b.context_tokens)] * round(b.batch)
        assert b.bytes == pytest.approx(fl.decode_bytes(LLAMA8B, ctx, 2, kv_dtype_bytes=1))
        kv_read = fl.kv_bytes_per_token(LLAMA8B, 2) * sum(ctx)
        assert a.bytes - b.bytes >= kv_read / 2  # half of every cached byte, at least
        assert b.bandwidth_utilization < a.bandwidth_utilization
        assert b.seconds == a.seconds and b.flops == a.flops
    for a, b in zip(full.prefill.levels, fp8.prefill.levels, strict=True):
        assert b.bytes < a.bytes and b.flops == a.flops  # the prompt's K/V written narrower
    # The optimizations start from the cache the target has.
    assert not narrower_kv_cache(fp8, LLAMA8B, HW).applicable
    bf16_from_fp32 = narrower_kv_cache(utilization(prof, LLAMA8B, HW, 4), LLAMA8B, HW)
    assert bf16_from_fp32.applicable and "bf16" in bf16_from_fp32.detail
    quant = quantized_weights(fp8, LLAMA8B, HW)
    assert (quant.speedup or 0) > (quantized_weights(full, LLAMA8B, HW).speedup or 0)
    result = run_steps(_sweep(), LLAMA8B, HW, 2.0, Workload(1000, 512, 64),
                       kv_dtype_bytes=1)
    assert result.utilization.kv_dtype_bytes == 1


def test_quantized_weights_are_priced_as_served() -> None:
    # An FP8 Llama on vLLM: half the weight bytes per decode step, FP8 matmuls for both phases
    # (the peak the FLOPs are held against), the K/V cache as wide as before.
    hw = get_hardware("h100-sxm")
    prof = profile(_sweep() + [_trace(512, conc=4, point="len=512 c=4") for _ in range(4)])
    bf16 = utilization(prof, LLAMA8B, hw)
    fp8 = utilization(prof, LLAMA8B, hw, weights=weight_format("fp8", "bfloat16"))
    assert (bf16.dtype, fp8.dtype) == ("bfloat16", "float8") and fp8.kv_dtype_bytes == 2
    weights_b = fl.param_count(LLAMA8B)
    for a, b in zip(bf16.decode.levels, fp8.decode.levels, strict=True):
        ctx = [round(b.context_tokens)] * round(b.batch)
        assert b.bytes == pytest.approx(fl.decode_bytes(LLAMA8B, ctx, 1.0, kv_dtype_bytes=2))
        assert a.bytes - b.bytes > 0.45 * weights_b  # a byte less for (nearly) every weight
        assert b.flops == a.flops and b.flops_utilization == pytest.approx(
            a.flops_utilization * hw.peak_bf16_flops_per_s / hw.peak_fp8_flops_per_s)
    assert not quantized_weights(fp8, LLAMA8B, hw).applicable
    assert "already fp8" in quantized_weights(fp8, LLAMA8B, hw).detail
    int4 = utilization(prof, LLAMA8B, hw, weights=weight_format("awq", "bfloat16"))
    assert int4.dtype == "bfloat16" and int4.weights.bytes_per_param == pytest.approx(0.515625)
    assert int4.decode.headline.bytes < fp8.decode.headline.bytes
    # The larger batch fits more streams beside fewer weight bytes.
    more = larger_decode_batch(int4, LLAMA8B, hw).detail
    assert "memory holds" in more


def test_a_larger_decode_batch_names_the_limits_that_stop_it_short() -> None:
    util = utilization(profile(_sweep()), LLAMA8B, HW)
    physical = larger_decode_batch(util, LLAMA8B, HW)
    assert physical.applicable and "pool" not in physical.detail
    context = round(util.decode.headline.context_tokens)
    small = larger_decode_batch(util, LLAMA8B, HW, ServingLimits(3 * (context + 1)))
    assert (small.before, small.after) == (physical.before, physical.after)  # still the bound
    assert "K/V pool holds" in small.detail and "about 3 such streams" in small.detail
    assert "sequences at once" not in small.detail
    roomy = larger_decode_batch(util, LLAMA8B, HW, ServingLimits(10**9, 10**4))
    assert roomy.detail == physical.detail
    capped = larger_decode_batch(util, LLAMA8B, HW, ServingLimits(10**9, 2))
    assert capped.detail.endswith("at most 2 sequences at once: past that raise --max-num-seqs "
                                  "(SGLang --max-running-requests)")
    result = run_steps(_sweep(), LLAMA8B, HW, 2.0, Workload(1000, 512, 64),
                       limits=ServingLimits(3 * (context + 1), 2))
    row = next(o for o in result.optimizations if o.name == "larger decode batch")
    assert "about 3 such streams" in row.detail and "at most 2 sequences" in row.detail


def test_batching_policy_gain_is_against_the_policy_the_engine_runs() -> None:
    results = [PolicyResult("mixed", 0.005, 0.500, 0.6, 100.0),
               PolicyResult("chunked", 0.004, 0.060, 0.2, 120.0),
               PolicyResult("disaggregated", 0.004, 0.006, 0.02, 300.0)]
    running_chunked = batching_policy(results, "chunked")
    assert running_chunked.name == "batching policy: disaggregated"
    assert running_chunked.before == 0.060 and running_chunked.after == 0.006
    assert running_chunked.applicable and running_chunked.speedup == pytest.approx(10.0)
    assert "against chunked; the audited engine runs chunked" in running_chunked.detail
    # Already on the best policy: nothing to change.
    assert not batching_policy(results, "disaggregated").applicable
    # Unknown policy: the measured range.
    unknown = batching_policy(results, None)
    assert unknown.before == 0.500 and unknown.speedup == pytest.approx(500 / 6)
    assert unknown.applicable and "against mixed" in unknown.detail


def test_compare_verdicts_print_the_table_ratios() -> None:
    from splitphase.audit.compare import PhaseSpeeds, verdicts

    base = PhaseSpeeds("a", 0.05, 0.003, 1000.0, 100.0, 50.0)
    other = PhaseSpeeds("b", 0.05, 0.003, 1050.0, 94.0, 50.0)
    assert verdicts([base, other]) == [
        "b vs a: prefill 1.05x faster, decode 0.94x (slower)"]
    same = PhaseSpeeds("c", 0.05, 0.003, 1020.0, 98.0, 50.0)
    assert verdicts([base, same])[0].endswith("prefill about the same (1.02x), "
                                              "decode about the same (0.98x)")
    stated = [PhaseSpeeds("a", 0.05, 0.003, 1000.0, 100.0, 50.0, "bfloat16"),
              PhaseSpeeds("b", 0.05, 0.003, 1000.0, 150.0, 50.0, "fp8")]
    assert verdicts(stated)[0].endswith("decode 1.50x faster (K/V cache fp8 vs bfloat16)")
    assert not verdicts([base, stated[1]])[0].endswith(")")  # one unstated: nothing to contrast
    quantized = [PhaseSpeeds("a", 0.05, 0.003, 1000.0, 100.0, 50.0, "bfloat16", "bfloat16"),
                 PhaseSpeeds("b", 0.05, 0.003, 1000.0, 180.0, 50.0, "fp8", "fp8")]
    assert verdicts(quantized)[0].endswith(
        "(K/V cache fp8 vs bfloat16; weights fp8 vs bfloat16)")


def test_compare_takes_the_dtype_our_server_states_for_its_weights() -> None:
    from splitphase.audit.compare import weights_of

    ours = {"kind": "openai", "quantization": None, "model_dtype": "bfloat16"}
    assert weights_of(ours) == "bfloat16"
    assert weights_of({**ours, "quantization": "fp8"}) == "fp8"  # a format says more
    assert weights_of({"kind": "openai", "quantization": None, "model_dtype": None}) is None
    assert weights_of({"kind": "builtin", "dtype": "float32"}) == "float32"


def test_measured_policies_supersede_the_ideal_isolation_gain() -> None:
    """Isolation's 'after' is the no-prefill baseline; where every batching policy of our own
    engine was measured, the achievable gain is that row's."""
    prof = _interference_profile()
    util = utilization(prof, LLAMA8B, HW)
    alone = optimizations(prof, util, LLAMA8B, HW)
    isolate = next(o for o in alone if o.name == "isolate prefill from decode")
    assert isolate.applicable and isolate.evidence == "measured"
    results = [PolicyResult("chunked", 0.02, 0.08, 0.1, 100.0),
               PolicyResult("disaggregated", 0.02, 0.04, 0.05, 90.0)]
    found = optimizations(prof, util, LLAMA8B, HW, results, "chunked")
    isolate = next(o for o in found if o.name == "isolate prefill from decode")
    assert not isolate.applicable and "measured in its own row" in isolate.detail
    policy = next(o for o in found if o.name.startswith("batching policy"))
    assert policy.applicable and policy.speedup == 2.0
    assert found.index(policy) < found.index(isolate)  # not applicable: listed after
