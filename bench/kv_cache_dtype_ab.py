"""The engine over an fp32 model with its K/V pool in fp32, bf16 and fp8, side by side.

Engines share one model (base-125m by default, fp32) and differ only in `kv_cache_dtype`
(`--pools`, the first the reference). Each round, in turn, each engine serves `--batch`
requests of `--context` prompt tokens and `--steps` output tokens; the prompts repeat across
rounds, so after the first the prefix cache holds all but their last block and a round is
mostly its decode steps, each at about `--context` tokens of K/V per sequence. Per engine:
the median decode step of its best round, the bytes that step reads in the audit's model
(weights plus K/V at the pool's width) over that time, and tokens per second. Then prefill
alone: `--prefill` tokens into each engine with prefix caching off, alternating, best time.
Prints each pool's time over the first's (< 1: the narrower pool is faster). Nothing is
asserted.

    OMP_NUM_THREADS=2 python bench/kv_cache_dtype_ab.py --batch 1 8 32 --context 512 2000
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from splitphase.audit.flops import decode_bytes
from splitphase.engine.kv_cache import kv_cache_torch_dtype
from splitphase.engine.llm import LLM
from splitphase.engine.sampling_params import SamplingParams
from splitphase.kernels import build
from splitphase.model.config import ModelConfig
from splitphase.model.tokenizer import Tokenizer
from splitphase.model.transformer import Transformer

POOLS = ("float32", "bfloat16", "fp8")


def _prompts(vocab: int, batch: int, length: int, seed: int) -> list[list[int]]:
    return [[(r * 131 + i * 7 + seed * 17) % (vocab - 5) + 5 for i in range(length)]
            for r in range(batch)]


def _engines(model: Transformer, pools: list[str], batch: int, tokens: int, caching: bool
             ) -> dict[str, LLM]:
    return {d: LLM(model, Tokenizer.default(), policy="chunked", max_num_seqs=batch,
                   num_blocks=batch * (-(-tokens // 16) + 1), kv_cache_dtype=d,
                   enable_prefix_caching=caching) for d in pools}


def _over_first(best: dict[str, float]) -> dict[str, float]:
    first = next(iter(best.values()))
    return {d: t / first for d, t in best.items()}


def decode_rows(model: Transformer, pools: list[str], batch: int, context: int, steps: int,
                rounds: int) -> dict[str, Any]:
    """Median decode step of each engine's best round, at `context` tokens a sequence."""
    llms = _engines(model, pools, batch, context + steps, caching=True)
    prompts = _prompts(model.cfg.vocab_size, batch, context, seed=context)
    params = [SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)] * batch
    best = {d: float("inf") for d in pools}
    for r in range(rounds + 1):  # the first round fills the prefix caches, untimed
        for d, llm in llms.items():
            llm.engine.steps.clear()
            llm.generate(prompts, params)
            walls = [s.wall_s for s in llm.engine.steps
                     if s.num_prefill_tokens == 0 and s.num_decode_seqs == batch]
            if r:  # the prompts' last blocks fit one step: all `batch` then decode together
                best[d] = min(best[d], statistics.median(walls))
    lens = [context + steps // 2] * batch
    row: dict[str, Any] = {"batch": batch, "context": context}
    for d in pools:
        kv_bytes = kv_cache_torch_dtype(d, torch.float32).itemsize
        step_bytes = decode_bytes(model.cfg, lens, 4, kv_dtype_bytes=kv_bytes)
        row[d] = {"step_s": best[d], "tok_per_s": batch / best[d],
                  "bytes_per_step": step_bytes, "bytes_per_s": step_bytes / best[d]}
    row["time_over_first"] = _over_first(best)
    return row


def prefill_row(model: Transformer, pools: list[str], tokens: int, rounds: int
                ) -> dict[str, Any]:
    """Best time of a `tokens`-long prefill into each engine (no prefix cache)."""
    llms = _engines(model, pools, 1, tokens + 1, caching=False)
    params = [SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)]
    best = {d: float("inf") for d in pools}
    for r in range(rounds + 1):  # the first round pays first-call costs, untimed
        for d, llm in llms.items():
            llm.engine.steps.clear()
            llm.generate(_prompts(model.cfg.vocab_size, 1, tokens, seed=r), params)
            if r:
                wall = sum(s.wall_s for s in llm.engine.steps if s.num_prefill_tokens)
                best[d] = min(best[d], wall)
    return {"tokens": tokens, **{d: {"step_s": best[d]} for d in pools},
            "time_over_first": _over_first(best)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="base-125m")
    ap.add_argument("--pools", nargs="+", default=list(POOLS),
                    help="kv_cache_dtype values; the first is the reference")
    ap.add_argument("--batch", type=int, nargs="+", default=[8])
    ap.add_argument("--context", type=int, nargs="+", default=[512, 2000])
    ap.add_argument("--steps", type=int, default=16, help="output tokens a request")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name(args.preset)).eval()
    print(f"{args.preset} fp32, {torch.get_num_threads()} threads, kernels: "
          f"{build.status().reason}")
    pools = args.pools
    rows = [decode_rows(model, pools, b, c, args.steps, args.rounds)
            for b in args.batch for c in args.context]
    print(f"decode step (ms, GB/s, time over {pools[0]}'s) with the K/V pool in: "
          + ", ".join(pools))
    for r in rows:
        cells = [f"{d} {r[d]['step_s'] * 1e3:.2f} ms {r[d]['bytes_per_s'] / 1e9:.1f} GB/s "
                 f"{r['time_over_first'][d]:.3f}x" for d in pools]
        print(f"  batch {r['batch']:3d} context {r['context']:5d}: " + " | ".join(cells))
    pre = prefill_row(model, pools, args.prefill, args.rounds)
    print(f"prefill {pre['tokens']}: " + " | ".join(
        f"{d} pool {pre[d]['step_s'] * 1e3:.1f} ms {pre['time_over_first'][d]:.3f}x"
        for d in pools))
    if args.out:
        Path(args.out).write_text(json.dumps({"decode": rows, "prefill": pre}, indent=1))


if __name__ == "__main__":
    main()
