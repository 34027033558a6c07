"""Decode attention alone against the memory speed this machine's decode reaches, in one process.

One decode step's attention over a preset's layers (base-125m: 12 layers, 12 query heads over
4 K/V heads of 64): each layer's K/V pool (slots, G, D) holds `batch` contexts of `context`
tokens in blocks of 16 slots (the engine's default; `--block` times other sizes), shuffled as
a paged cache leaves them, and one query token per sequence attends to its own. Between
layers a buffer larger than the last-level cache is read, untimed, as a step's weights would
stream through: each layer's K/V comes from memory.
"native" is `torch.ops.splitphase.decode_attention`; "stream" moves the same pools through
the batch-1 linear kernel (each pool as a weight of up to 1024 columns times one row), the
speed at which decode streams its weights here: what reading these bytes could take.
"cached" is native again with every sequence and layer on one context's slots, no flush: the
same arithmetic from the caches (a few MB), so cold native near cached means the kernel is
bound by its instructions, and far above it, by memory. All run
on the kernels' own threads; nothing in the loop uses torch's OpenMP team, whose threads spin
after each region and would take the second core from the kernel's helper (with the flush in
torch, a b1 step at context 512 took 8 ms against 1). Variants alternate layer set by layer
set; each figure is the best round. Prints ms per step, the bytes each read over that time
(native: the contexts' K/V; stream: the whole pools, the same where context is a multiple of
the block), native's GB/s as a fraction of the stream's, and native's time over cached's.
Nothing is asserted.

    OMP_NUM_THREADS=2 python bench/decode_attention_ab.py --batch 1 8 --context 512 2048
    python bench/decode_attention_ab.py --batch 8 32 --context 2048 --pool fp8  # fp32 q, fp8 K/V
    python bench/decode_attention_ab.py --batch 8 32 --context 2048 --block 16 64  # block sizes
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Callable
from functools import partial

import torch

from splitphase.kernels import build
from splitphase.model.config import ModelConfig

BLOCK = 16  # the engine's default block size (EngineConfig.block_size)
FLUSH_BYTES = 64 << 20  # past this host's 32 MiB L3
POOLS = {"same": None, "bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn,
         "fp8_e5m2": torch.float8_e5m2}
STREAM_COLS = 1024  # at most; base-125m's pools of BLOCK-slot blocks are whole such rows


def stream(*tensors: torch.Tensor) -> object:
    """Reads `tensors` through the batch-1 linear kernel, each as a weight of up to
    STREAM_COLS columns times a row of ones."""
    if tensors[0].element_size() == 1:  # fp8: the same bytes, read as bf16 (no fp8 linear)
        tensors = tuple(t.view(torch.bfloat16) for t in tensors)
    cols = math.gcd(tensors[0].numel(), STREAM_COLS)
    x = torch.ones(1, cols, dtype=tensors[0].dtype)
    return torch.ops.splitphase.skinny_linear(x, [t.view(-1, cols) for t in tensors], 0)


def paged_slots(batch: int, context: int, gen: torch.Generator, block: int = BLOCK
                ) -> torch.Tensor:
    """(batch, context) slots: each sequence's blocks of `block` slots, shuffled over the pool."""
    blocks = -(-context // block)
    order = torch.randperm(batch * blocks, generator=gen)
    table = order.view(batch, blocks)
    pos = torch.arange(context)
    return table[:, pos // block] * block + pos % block


class Layers:
    """A step's K/V pools, one per layer, and the queries and slots that read them."""

    def __init__(self, cfg: ModelConfig, batch: int, context: int, dtype: torch.dtype,
                 block: int = BLOCK, pool_dtype: torch.dtype | None = None) -> None:
        gen = torch.Generator().manual_seed(0)
        slots_n = batch * -(-context // block) * block
        shape = (slots_n, cfg.n_kv_heads, cfg.head_dim)
        self.pools = [
            tuple(torch.randn(shape, generator=gen).to(pool_dtype or dtype) for _ in "kv")
            for _ in range(cfg.n_layers)
        ]
        self.q = torch.randn(batch, cfg.n_heads, cfg.head_dim, generator=gen).to(dtype)
        self.slots = paged_slots(batch, context, gen, block)
        self.shared_slots = torch.arange(context).repeat(batch, 1)  # one context for all
        self.lengths = torch.full((batch,), context, dtype=torch.long)
        self.flush = torch.zeros(FLUSH_BYTES // 4)
        per_token = 2 * cfg.n_kv_heads * cfg.head_dim * self.pools[0][0].element_size()
        self.bytes = {
            "native": cfg.n_layers * batch * context * per_token,
            "stream": cfg.n_layers * slots_n * per_token,
        }

    def step_s(self, fn: Callable[[torch.Tensor, torch.Tensor], object]) -> float:
        """Seconds of `fn` over every layer's pools, each layer after an untimed flush."""
        total = 0.0
        for k, v in self.pools:
            stream(self.flush)  # untimed: evicts the last layer's K/V
            t0 = time.perf_counter()
            fn(k, v)
            total += time.perf_counter() - t0
        return total

    def cached_step_s(self) -> float:
        """Seconds of native attention for every layer over one shared context, warm."""
        k, v = self.pools[0]
        call = partial(torch.ops.splitphase.decode_attention, self.q, k, v, self.shared_slots,
                       self.lengths)
        call()  # untimed: brings the context into the caches
        t0 = time.perf_counter()
        for _ in self.pools:
            call()
        return time.perf_counter() - t0


def variants(layers: Layers) -> dict[str, Callable[[torch.Tensor, torch.Tensor], object]]:
    q, slots, lengths = layers.q, layers.slots, layers.lengths

    def native(k: torch.Tensor, v: torch.Tensor) -> object:
        return torch.ops.splitphase.decode_attention(q, k, v, slots, lengths)

    return {"native": native, "stream": stream}


def best_steps(layers: Layers, rounds: int) -> dict[str, float]:
    fns = variants(layers)
    best = {name: float("inf") for name in [*fns, "cached"]}
    for r in range(rounds + 1):  # round 0 warms up and is not kept
        for name, fn in fns.items():
            s = layers.step_s(fn)
            if r:
                best[name] = min(best[name], s)
        s = layers.cached_step_s()
        if r:
            best["cached"] = min(best["cached"], s)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="base-125m")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--pool", choices=list(POOLS), default="same",
                    help="the K/V pools' dtype (kv_cache_dtype), queries in --dtype")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--block", type=int, nargs="+", default=[BLOCK],
                    help="slots a K/V block (EngineConfig.block_size), each timed in turn")
    args = ap.parse_args()
    if not build.available():
        raise SystemExit(f"native kernels unavailable: {build.status().reason}")
    cfg = ModelConfig.from_name(args.preset)
    dtype = getattr(torch, args.dtype)
    torch.set_grad_enabled(False)
    pool = POOLS[args.pool] or dtype
    print(f"threads {torch.get_num_threads()}, {args.dtype} queries over {pool} pools, "
          f"{cfg.n_layers} layers, H {cfg.n_heads} G {cfg.n_kv_heads} D {cfg.head_dim}, "
          f"load before {os.getloadavg()}")
    for batch in args.batch:
        for context in args.context:
            for block in args.block:
                _report(Layers(cfg, batch, context, dtype, block, pool), args.rounds,
                        f"b{batch} context {context} block {block}")
    print(f"load after {os.getloadavg()}")


def _report(layers: Layers, rounds: int, label: str) -> None:
    best = best_steps(layers, rounds)
    rate = {name: layers.bytes[name] / best[name] / 1e9 for name in ("native", "stream")}
    print(f"{label}: " + ", ".join(
        f"{name} {1e3 * best[name]:.2f} ms {rate[name]:.1f} GB/s" for name in rate)
        + f", cached {1e3 * best['cached']:.2f} ms; native at "
        f"{100 * rate['native'] / rate['stream']:.0f}% of the stream's GB/s, "
        f"{best['native'] / best['cached']:.2f}x cached's time")


if __name__ == "__main__":
    main()
