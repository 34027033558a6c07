"""The engine's flags, shared by `splitphase serve` and `splitphase generate` (vLLM's names)."""

from __future__ import annotations

import argparse
from typing import Any

from splitphase.engine.config import KV_CACHE_DTYPES

_BYTE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
               "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def byte_count(text: str) -> int:
    """"4000000000", "4G", "3.5GiB", "512Mi" -> bytes (decimal k/M/G/T, binary Ki/Mi/Gi/Ti)."""
    raw = text.replace(" ", "").lower().removesuffix("b")
    unit = raw.lstrip("0123456789.e+")
    try:
        value = float(raw[: len(raw) - len(unit)]) * _BYTE_UNITS[unit]
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a byte count (e.g. 4000000000, 4G, 3.5GiB)") from None
    return int(value)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Batch limits, K/V cache layout and size; `engine_kwargs` reads them back."""
    parser.add_argument("--max-num-seqs", type=int, default=64, help="sequences per batch")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="tokens one step may carry (chunked: the prefill chunk budget)")
    parser.add_argument("--block-size", type=int, default=16,
                        help="tokens per K/V cache block")
    parser.add_argument("--max-model-len", type=int, help="longest prompt plus output a "
                        "request may have (default: the model's max_seq_len, or what the pool "
                        "holds)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=True, help="reuse the K/V blocks of a prompt prefix seen before")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="dtype of the paged K/V pool (auto: the model's); bfloat16 under "
                        "an fp32 model holds twice the tokens in the same memory")
    parser.add_argument("--kv-cache-bytes", "--kv-cache-memory-bytes", type=byte_count,
                        metavar="BYTES", help="memory of the K/V pool, e.g. 4G or 3.5GiB (the "
                        "second name is vLLM's; default: a quarter of free memory, at most what "
                        "--max-num-seqs sequences of --max-model-len use)")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The flags `add_engine_arguments` added, as EngineConfig fields."""
    return {name: getattr(args, name) for name in (
        "max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len",
        "enable_prefix_caching", "kv_cache_dtype", "kv_cache_bytes")}
