"""Server-side phase times from a Prometheus `/metrics` page (vLLM, SGLang and our names).

Histograms are aggregates, so the audit scrapes before and after each probe point and takes
the per-request mean of the difference: delta(_sum) / delta(_count).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator

# Candidates per phase, first match wins. vLLM and ours have explicit prefill/decode histograms;
# SGLang has queue, TTFT and inter-token latency, so its prefill is TTFT minus queue.
PHASE_METRICS: dict[str, tuple[str, ...]] = {
    "queue": (
        "splitphase:request_queue_time_seconds",
        "vllm:request_queue_time_seconds",
        "sglang:queue_time_seconds",
    ),
    "prefill": ("splitphase:request_prefill_time_seconds", "vllm:request_prefill_time_seconds"),
    "ttft": (
        "splitphase:time_to_first_token_seconds",
        "vllm:time_to_first_token_seconds",
        "sglang:time_to_first_token_seconds",
    ),
    "decode": (  # whole decode phase per request; per token needs the generated-token counter
        "splitphase:request_decode_time_seconds",
        "vllm:request_decode_time_seconds",
    ),
    "itl": (
        "splitphase:inter_token_latency_seconds",
        "vllm:inter_token_latency_seconds",
        "sglang:inter_token_latency_seconds",
        "splitphase:time_per_output_token_seconds",
        "vllm:time_per_output_token_seconds",
        "sglang:time_per_output_token_seconds",
    ),
}
# Requests whose K/V blocks were taken back for others (SGLang: "retracted").
PREEMPTIONS = (
    "splitphase:num_preemptions_total",
    "vllm:num_preemptions_total",
    "sglang:num_retracted_requests_total",
)
GENERATION_TOKENS = (
    "splitphase:generation_tokens_total",
    "vllm:generation_tokens_total",
    "sglang:generation_tokens_total",
)

# vLLM's info metric (labels from its CacheConfig) and ours carry the K/V cache's dtype, block
# size and block count. SGLang states the pool's tokens in a gauge, once per tensor-parallel
# rank (each holds every token's share).
CACHE_CONFIG_INFO = ("splitphase:cache_config_info", "vllm:cache_config_info")
POOL_TOKENS = "sglang:max_total_num_tokens"
# How many sequences run at once: our info metric's label, SGLang's gauge (vLLM states none).
SCHEDULER_CONFIG_INFO = "splitphase:scheduler_config_info"
MODEL_CONFIG_INFO = "splitphase:model_config_info"  # the dtype our engine computes in
MAX_RUNNING = "sglang:max_running_requests"

_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="([^"]*)"')


def _info_labels(text: str, names: tuple[str, ...] = CACHE_CONFIG_INFO) -> dict[str, str]:
    """The labels of the first sample of an info metric ({} when there is none)."""
    for line in text.splitlines():
        if line.split("{", 1)[0].strip() in names and "{" in line:
            return dict(_LABEL.findall(line.split("{", 1)[1].rsplit("}", 1)[0]))
    return {}


def cache_dtype(text: str) -> str | None:
    """The K/V cache dtype a server's /metrics states ("auto": the model's), or None.
    vLLM's fp8 variants (fp8_inc, fp8_ds_mla, ...) all store one byte: they read as "fp8"."""
    value = _info_labels(text).get("cache_dtype")
    if value is not None and value.startswith("fp8") and value not in ("fp8_e4m3", "fp8_e5m2"):
        return "fp8"
    return value


def _positive_int(value: str | float | None) -> int | None:
    try:
        number = int(float(value))  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return None  # vLLM states num_gpu_blocks="None" before its profiling run
    return number if number > 0 else None


def kv_pool_tokens(text: str) -> int | None:
    """Tokens the server's K/V pool holds (blocks x block size), or None if it does not say."""
    labels = _info_labels(text)
    block_size = _positive_int(labels.get("block_size"))
    blocks = _positive_int(labels.get("num_gpu_blocks"))
    if block_size and blocks:
        return block_size * blocks
    return _positive_int(_gauge(text, POOL_TOKENS))


def scheduler_policy(text: str) -> str | None:
    """The batching policy our server states (mixed, chunked, disaggregated), or None."""
    return _info_labels(text, (SCHEDULER_CONFIG_INFO,)).get("policy")


def model_dtype(text: str) -> str | None:
    """The dtype our server's engine computes in (`serve --dtype`), or None."""
    return _info_labels(text, (MODEL_CONFIG_INFO,)).get("dtype")


def max_num_seqs(text: str) -> int | None:
    """Sequences the server runs at once, where its /metrics says."""
    stated = _info_labels(text, (SCHEDULER_CONFIG_INFO,)).get("max_num_seqs")
    return _positive_int(stated) or _positive_int(_gauge(text, MAX_RUNNING))


def _gauge(text: str, name: str) -> float | None:
    """The largest sample of one metric over its label sets (ranks state the same pool)."""
    return max((value for sample, value in _sample_lines(text) if sample == name), default=None)


def _sample_lines(text: str) -> Iterator[tuple[str, float]]:
    """(name, value) of each sample line of the text exposition; comments and junk skipped."""
    for line in text.splitlines():
        match = _LINE.match(line.strip())
        if line.startswith("#") or not match:
            continue
        try:
            yield match.group(1), float(match.group(3))
        except ValueError:
            continue


def _parse_small(text: str) -> dict[str, float]:
    samples: dict[str, float] = {}
    for name, value in _sample_lines(text):
        samples[name] = samples.get(name, 0.0) + value
    return samples


def parse_samples(text: str) -> dict[str, float]:
    """Sample name -> value summed over label sets (prometheus_client's parser when installed)."""
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        return _parse_small(text)
    samples: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    continue  # buckets are not needed and carry an extra `le` label
                samples[sample.name] = samples.get(sample.name, 0.0) + float(sample.value)
    except (ValueError, TypeError):
        return _parse_small(text)  # a page prometheus_client rejects may still be readable
    return samples


def known_metrics(samples: dict[str, float]) -> list[str]:
    """The phase histograms present in a scrape."""
    names = (n for group in PHASE_METRICS.values() for n in group)
    return [n for n in names if f"{n}_count" in samples]


def phase_means_s(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Per-request mean seconds per phase between two scrapes; phases without data are absent."""
    means: dict[str, float] = {}
    for phase, names in PHASE_METRICS.items():
        for name in names:
            count = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
            total = after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)
            if count > 0 and math.isfinite(total) and total >= 0:
                means[phase] = total / count
                break
    if "prefill" not in means and {"ttft", "queue"} <= means.keys():
        means["prefill"] = max(0.0, means["ttft"] - means["queue"])
    if "itl" not in means:
        _decode_per_token(before, after, means)
    return means


def _delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def _decode_per_token(
    before: dict[str, float], after: dict[str, float], means: dict[str, float]
) -> None:
    """Mean step time from decode-phase seconds over tokens after each request's first."""
    for name in PHASE_METRICS["decode"]:
        requests = _delta(before, after, f"{name}_count")
        if requests <= 0:
            continue
        for counter in GENERATION_TOKENS:
            steps = _delta(before, after, counter) - requests  # the first token is prefill's
            if steps > 0:
                means["itl"] = _delta(before, after, f"{name}_sum") / steps
                return


def preemptions(before: dict[str, float], after: dict[str, float]) -> int | None:
    """Preemptions between two scrapes; None when the server does not count them."""
    for name in PREEMPTIONS:
        if name in after:
            return max(0, round(after[name] - before.get(name, 0.0)))
    return None


def observations(before: dict[str, float], after: dict[str, float]) -> int:
    """How many requests finished between two scrapes, by the first TTFT-like histogram."""
    for names in (PHASE_METRICS["ttft"], PHASE_METRICS["prefill"]):
        for name in names:
            if f"{name}_count" in after:
                return int(after[f"{name}_count"] - before.get(f"{name}_count", 0.0))
    return 0
