"""Timing of our model's two phases: decode steps over a filled cache, and prefill passes.

Each figure is the best of several timed runs: on a shared machine another job can take a
core for whole scheduler slices (a two-thread step then waits tens of milliseconds at a
barrier), and the best run is the one such stalls did not hit. Every system compared is
timed the same way. The analytical FLOPs and bytes come
from `splitphase.audit.flops`, so "bandwidth" here means bytes the step must move over the
step's wall time, not a hardware counter.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from splitphase.audit.flops import decode_bytes, decode_flops, prefill_flops
from splitphase.model.attention_context import KVCache
from splitphase.model.config import ModelConfig
from splitphase.model.transformer import Transformer


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # GPU work is asynchronous: time it to completion


def best_s(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Best wall time of fn over `repeats` runs after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    _sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return min(times)


def interleaved_best_s(
    systems: dict[str, Callable[[], object]], rounds: int, burst: int = 4
) -> dict[str, float]:
    """Best wall time of each callable, timed in alternating bursts of `burst` calls.

    On a host whose memory speed moves between minutes, systems timed one after the other
    meet different machines; alternating short bursts in one process gives each the same
    spells. One untimed call each first."""
    for fn in systems.values():
        fn()
    _sync()
    best = dict.fromkeys(systems, float("inf"))
    for _ in range(rounds):
        for name, fn in systems.items():
            for _ in range(burst):
                t0 = time.perf_counter()
                fn()
                _sync()
                best[name] = min(best[name], time.perf_counter() - t0)
    return best


def decode_step_fn(model: Transformer, batch: int, context: int) -> Callable[[], None]:
    """One decode step at `context` cached tokens per row, repeatable (the cache stays there)."""
    cache = filled_cache(model, batch, context, 1)
    ids = torch.randint(0, model.cfg.vocab_size, (batch,), device=model.device)

    def step() -> None:
        model.decode_step(ids, cache)
        cache.length -= 1  # stay at `context`: every timed step costs the same

    return step


@dataclass(frozen=True)
class DecodeTiming:
    """One decode configuration: batch, context, best step time and what it implies."""

    batch: int
    context: int
    step_s: float
    bytes_per_step: float
    flops_per_step: float

    @property
    def tok_per_s(self) -> float:
        return self.batch / self.step_s

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.bytes_per_step / self.step_s


def filled_cache(model: Transformer, batch: int, context: int, extra: int) -> KVCache:
    """A cache holding `context` positions of random K/V (decode cost does not depend on it)."""
    cache = model.new_cache(batch, context + extra)
    g = torch.Generator(device="cpu").manual_seed(0)
    for t in (cache.k, cache.v):
        t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.device, t.dtype))
    cache.length = context
    return cache


def time_decode(model: Transformer, batch: int, context: int, steps: int) -> DecodeTiming:
    """Best time of one decode step at `context` cached tokens per row."""
    cfg = model.cfg
    step_s = best_s(decode_step_fn(model, batch, context), steps, warmup=2)
    dtype_bytes = torch.empty(0, dtype=model.dtype).element_size()
    lens = [context] * batch
    return DecodeTiming(
        batch, context, step_s, decode_bytes(cfg, lens, dtype_bytes), decode_flops(cfg, lens)
    )


def prefill_fn(model: Transformer, prompt_len: int) -> Callable[[], None]:
    """One prefill of a random prompt into a fresh cache, repeatable."""
    ids = torch.randint(0, model.cfg.vocab_size, (1, prompt_len), device=model.device)
    cache = model.new_cache(1, prompt_len)

    def run() -> None:
        cache.length = 0
        model.prefill(ids, cache)

    return run


def time_prefill(model: Transformer, prompt_len: int, repeats: int) -> tuple[float, float]:
    """(best seconds, analytical FLOPs) of prefilling one prompt into a fresh cache."""
    return best_s(prefill_fn(model, prompt_len), repeats), prefill_flops(model.cfg, prompt_len)


def overhead_model(cfg: ModelConfig) -> Transformer:
    """The same op graph (layers, heads, GQA) with near-empty tensors: times the dispatch."""
    small = cfg.with_(d_model=16, head_dim=4, d_ff=16, vocab_size=64, name=cfg.name + "-shape")
    torch.manual_seed(0)
    return Transformer(small).eval()


def time_step_overhead(
    cfg: ModelConfig,
    steps: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> float:
    """Seconds per batch-1 decode step spent outside the arithmetic (Python, dispatch, launch).

    Timed over one cached token: attention's cost grows with the context whatever the head
    size, so at the real context the tiny model spent more on it than base-125m's own step does
    (at 512 tokens, 1.5 ms against 0.5 ms over one token, where base-125m's attention adds
    0.7-0.9 ms to its step), and the figure counted attention as overhead."""
    model = overhead_model(cfg).to(device=device, dtype=dtype)
    return time_decode(model, 1, 1, steps).step_s
