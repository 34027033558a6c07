"""Prometheus metrics of one server: a registry per app (no module-global state).

Names mirror vLLM's, so a vLLM dashboard ports by replacing the `vllm:` prefix with
`splitphase:` (every series carries a `model_name` label, as vLLM's do):

    vllm:time_to_first_token_seconds     -> splitphase:time_to_first_token_seconds
    vllm:inter_token_latency_seconds     -> splitphase:inter_token_latency_seconds (each gap)
    vllm:request_time_per_output_token_seconds
                                         -> splitphase:time_per_output_token_seconds (per request)
    vllm:request_queue_time_seconds      -> splitphase:request_queue_time_seconds
    vllm:request_prefill_time_seconds    -> splitphase:request_prefill_time_seconds
    vllm:request_decode_time_seconds     -> splitphase:request_decode_time_seconds
    vllm:e2e_request_latency_seconds     -> splitphase:e2e_request_latency_seconds
    vllm:prompt_tokens_total             -> splitphase:prompt_tokens_total
    vllm:generation_tokens_total         -> splitphase:generation_tokens_total
    vllm:request_success_total{finished_reason}
                                         -> splitphase:request_success_total{finished_reason}
    vllm:iteration_tokens_total          -> splitphase:iteration_tokens_total (a histogram, as
                                            vLLM's: tokens per engine step)
    vllm:request_prompt_tokens / _generation_tokens
                                         -> splitphase:request_prompt_tokens / _generation_tokens
    vllm:num_preemptions_total           -> splitphase:num_preemptions_total
    vllm:prefix_cache_queries_total / _hits_total
                                         -> splitphase:prefix_cache_queries_total / _hits_total
                                            (tokens; all three counted as requests finish)
    vllm:num_requests_running / _waiting -> splitphase:num_requests_running / _waiting
    vllm:kv_cache_usage_perc             -> splitphase:kv_cache_usage_perc (0..1), plus
                                            splitphase:kv_cache_blocks_used / _total
    vllm:cache_config_info{cache_dtype,block_size,num_gpu_blocks}
                                         -> splitphase:cache_config_info{the same} (the pool's
                                            dtype, "auto" resolved to the model's; a
                                            disaggregated pair's blocks are the decode
                                            worker's pool, its kv_cache_blocks_total adds both)
    (no vLLM equivalent)                 -> splitphase:prefill_flops_utilization,
                                            splitphase:decode_bandwidth_utilization,
                                            splitphase:scheduler_config_info{policy,
                                            max_num_seqs,max_num_batched_tokens}

Every finished request (any reason, aborts and errors included) is observed once in the
e2e histogram and the success counter; the phase histograms get the phases it reached. The two
utilization gauges are the analytical FLOPs (bytes) of the prefill (decode) steps of the last
`window_s` seconds over those steps' wall time, divided by the hardware's peak FLOP/s (memory
bandwidth): 0.3 means the steps ran at 30% of the roofline ceiling.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from splitphase.engine.llm_engine import StepRecord
from splitphase.engine.request import Request
from splitphase.hardware.specs import HardwareError, HardwareSpec, get_hardware, hardware_for_gpu

log = logging.getLogger("splitphase.server")

# vLLM's buckets, extended below 10 ms where small models on CPUs and fast GPUs live.
TOKEN_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                   0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                     5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
# Tokens: vLLM's step buckets, and its 1-2-5 series for a request's prompt and output.
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_TOKEN_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's queues and KV pool (None where the engine cannot say)."""

    running: int
    waiting: int
    kv_blocks_used: int | None = None
    kv_blocks_total: int | None = None


def resolve_hardware(name: str | None, device: str) -> HardwareSpec | None:
    """The peaks for the gauges: the named spec, else `cpu` (measured) or a guessed GPU."""
    if name is not None:
        return get_hardware(name)
    if not device.startswith("cuda"):
        return get_hardware("cpu")
    import torch

    gpu = torch.cuda.get_device_name(0)
    table_name = hardware_for_gpu(gpu)
    if table_name is not None:
        return get_hardware(table_name)
    log.warning("no peaks known for %r: pass --hardware NAME for the utilization gauges", gpu)
    return None


def utilization(steps: Iterable[StepRecord], peak_flops_per_s: float,
                peak_bytes_per_s: float) -> tuple[float, float]:
    """(prefill FLOP utilization, decode bandwidth utilization) of these steps, 0 when none."""
    pf_flops = pf_s = dec_bytes = dec_s = 0.0
    for s in steps:
        if s.phase in ("prefill", "mixed"):  # a mixed step is prefill-bound: count its FLOPs
            pf_flops, pf_s = pf_flops + s.flops, pf_s + s.wall_s
        elif s.phase == "decode":
            dec_bytes, dec_s = dec_bytes + s.bytes, dec_s + s.wall_s
    prefill = pf_flops / pf_s / peak_flops_per_s if pf_s > 0 else 0.0
    decode = dec_bytes / dec_s / peak_bytes_per_s if dec_s > 0 else 0.0
    return prefill, decode


class ServerMetrics:
    """The histograms, counters and gauges of one app, in their own registry."""

    def __init__(self, model_name: str, hardware: HardwareSpec | None, dtype: str,
                 window_s: float = 10.0, kv_cache_dtype: str = "auto",
                 kv_pool: tuple[int, int] | None = None,
                 scheduler: dict[str, str] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.window_s = window_s
        self._peaks = _peaks(hardware, dtype)
        self._steps: deque[tuple[float, StepRecord]] = deque(maxlen=8192)
        self._lock = threading.Lock()
        self._model = model_name
        lab = ["model_name"]

        def hist(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            metric = Histogram(name, doc, lab, registry=self.registry, buckets=buckets)
            return metric.labels(model_name)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, lab, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, lab, registry=self.registry).labels(model_name)

        p = "splitphase:"
        self.ttft = hist(p + "time_to_first_token_seconds", "Arrival to first token.",
                         REQUEST_BUCKETS_S)
        self.itl = hist(p + "inter_token_latency_seconds", "Gap between consecutive tokens.",
                        TOKEN_BUCKETS_S)
        self.tpot = hist(p + "time_per_output_token_seconds",
                         "Mean time per output token after the first, per request.",
                         TOKEN_BUCKETS_S)
        self.queue = hist(p + "request_queue_time_seconds", "Arrival to first scheduled.",
                          REQUEST_BUCKETS_S)
        self.prefill = hist(p + "request_prefill_time_seconds",
                            "First scheduled to first token.", REQUEST_BUCKETS_S)
        self.decode = hist(p + "request_decode_time_seconds", "First token to last token.",
                           REQUEST_BUCKETS_S)
        self.e2e = hist(p + "e2e_request_latency_seconds", "Arrival to finish.",
                        REQUEST_BUCKETS_S)
        self.prompt_tokens = counter(p + "prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = counter(p + "generation_tokens", "Generated tokens.")
        self.step_tokens = hist(p + "iteration_tokens_total", "Tokens per engine step: "
                                "prefill tokens plus one per decoding sequence.",
                                STEP_TOKEN_BUCKETS)
        self.request_prompt = hist(p + "request_prompt_tokens", "Prompt tokens per finished "
                                   "request.", REQUEST_TOKEN_BUCKETS)
        self.request_output = hist(p + "request_generation_tokens", "Generated tokens per "
                                   "finished request.", REQUEST_TOKEN_BUCKETS)
        self.preemptions = counter(p + "num_preemptions", "Preemptions: a request's K/V blocks "
                                   "taken back for others; it recomputes them later.")
        self.prefix_queries = counter(p + "prefix_cache_queries", "Tokens looked up in the "
                                      "prefix cache at admission (a preempted request's again).")
        self.prefix_hits = counter(p + "prefix_cache_hits", "Tokens found in the prefix cache.")
        self._success = Counter(p + "request_success", "Finished requests by reason.",
                                [*lab, "finished_reason"], registry=self.registry)
        self.running = gauge(p + "num_requests_running", "Sequences in the running batch.")
        self.waiting = gauge(p + "num_requests_waiting", "Sequences waiting for a seat.")
        self.kv_used = gauge(p + "kv_cache_blocks_used", "KV blocks held by requests.")
        self.kv_total = gauge(p + "kv_cache_blocks_total", "KV blocks in the pool.")
        self.kv_perc = gauge(p + "kv_cache_usage_perc", "Fraction of KV blocks in use (0..1).")
        self.prefill_util = gauge(p + "prefill_flops_utilization",
                                  "Prefill steps' FLOP/s over the peak FLOP/s, recent window.")
        self.decode_util = gauge(p + "decode_bandwidth_utilization",
                                 "Decode steps' bytes/s over the peak bandwidth, recent window.")
        for reason in ("stop", "length", "abort", "error"):  # present from the first scrape
            self._success.labels(model_name, reason)
        # An info metric as vLLM's: an auditor prices decode's K/V bytes at this width and
        # knows how many tokens the pool decode runs in holds (kv_pool: block size, blocks).
        cache = dtype if kv_cache_dtype == "auto" else kv_cache_dtype
        info = {"cache_dtype": cache}
        if kv_pool is not None:
            info |= {"block_size": str(kv_pool[0]), "num_gpu_blocks": str(kv_pool[1])}
        Gauge(p + "cache_config_info", "K/V cache configuration (value 1).",
              [*lab, *info], registry=self.registry).labels(model_name, *info.values()).set(1)
        # Ours alone: the dtype the engine computes in, which `serve --dtype` may set apart
        # from the checkpoint's config.json (an auditor prices the weights' bytes at it).
        Gauge(p + "model_config_info", "Model configuration (value 1).", [*lab, "dtype"],
              registry=self.registry).labels(model_name, dtype).set(1)
        if scheduler:  # vLLM states none: the batch limits an auditor's projections stop at
            Gauge(p + "scheduler_config_info", "Scheduler configuration (value 1).",
                  [*lab, *scheduler], registry=self.registry).labels(
                      model_name, *scheduler.values()).set(1)

    # ---- events (any thread) -----------------------------------------------------------------
    def on_steps(self, steps: Sequence[StepRecord]) -> None:
        """Engine-thread hook: remember recent steps for the utilization gauges."""
        now = time.monotonic()
        with self._lock:
            self._steps.extend((now, s) for s in steps)
        for step in steps:
            self.step_tokens.observe(step.num_prefill_tokens + step.num_decode_seqs)
            # Counted as the steps happen, as vLLM's; an engine that caches no prefixes looks
            # nothing up, so its counts stay 0 (vLLM's too).
            self.preemptions.inc(step.num_preemptions)
            self.prefix_queries.inc(step.prefix_cache_queries_tokens)
            self.prefix_hits.inc(step.prefix_cache_hits_tokens)

    def observe_finished(self, reason: str, request: Request | None, e2e_s: float) -> None:
        """One finished sequence: its phase times (those it reached) and its reason."""
        self._success.labels(self._model, reason).inc()
        self.e2e.observe(max(0.0, e2e_s))
        if request is None:
            return
        self.request_prompt.observe(len(request.prompt_token_ids))
        self.request_output.observe(len(request.output_token_ids))
        for hist, value in ((self.queue, request.queue_s), (self.prefill, request.prefill_s),
                            (self.ttft, request.ttft_s), (self.decode, request.decode_s),
                            (self.tpot, request.tpot_s)):
            if value is not None:
                hist.observe(max(0.0, value))
        for gap in request.inter_token_s:
            self.itl.observe(max(0.0, gap))

    # ---- scrape -----------------------------------------------------------------------------
    def refresh(self, stats: EngineStats) -> None:
        """Set the gauges from an engine snapshot and the recent steps."""
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        if stats.kv_blocks_total:
            used = stats.kv_blocks_used or 0
            self.kv_used.set(used)
            self.kv_total.set(stats.kv_blocks_total)
            self.kv_perc.set(used / stats.kv_blocks_total)
        if self._peaks is not None:
            horizon = time.monotonic() - self.window_s
            with self._lock:
                while self._steps and self._steps[0][0] < horizon:
                    self._steps.popleft()
                recent = [s for _, s in self._steps]
            prefill, decode = utilization(recent, *self._peaks)
            self.prefill_util.set(prefill)
            self.decode_util.set(decode)

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)


def _peaks(hardware: HardwareSpec | None, dtype: str) -> tuple[float, float] | None:
    if hardware is None:
        return None
    try:
        flops = hardware.peak_flops_per_s(dtype)
    except HardwareError:
        log.warning("%s has no %s peak; using its bf16 peak", hardware.name, dtype)
        flops = hardware.peak_bf16_flops_per_s
    return flops, hardware.mem_bandwidth_bytes_per_s
