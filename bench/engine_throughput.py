"""Engine throughput per batching policy, against Hugging Face transformers, side by side.

One run, one machine, one workload: N requests with prompts and outputs drawn uniformly
(seeded) from the given ranges, all submitted at once. For each policy the engine reports
output tokens/s and TTFT / inter-token latency percentiles; transformers runs the same
prompts with `generate` sequentially (batch 1) and batched (left padding). Ratios are printed
next to each other; nothing here is asserted.

    python bench/engine_throughput.py                      # base-125m, fp32, 64 requests
    python bench/engine_throughput.py --preset tiny --requests 8 --quick
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from splitphase.audit.flops import kv_bytes_per_token
from splitphase.engine.llm import LLM
from splitphase.engine.sampling_params import SamplingParams
from splitphase.model.config import ModelConfig
from splitphase.model.tokenizer import Tokenizer
from splitphase.model.transformer import Transformer
from splitphase.perf.hf_baseline import hf_llama


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def workload(
    n: int, prompt_range: tuple[int, int], out_range: tuple[int, int], vocab: int, seed: int = 0
) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(5, vocab) for _ in range(rng.randint(*prompt_range))],
            rng.randint(*out_range),
        )
        for _ in range(n)
    ]


def kv_bytes_for(cfg: ModelConfig, work) -> int:
    """A KV pool that holds the whole workload at once (plus a block per request of slack),
    so no policy preempts and recomputes: that would measure the pool, not the policy."""
    tokens = sum(len(p) + o + 16 for p, o in work)
    return tokens * kv_bytes_per_token(cfg, dtype_bytes=4)


def run_engine(model: Transformer, tok: Tokenizer, work, policy: str, budget: int) -> dict:
    llm = LLM(
        model,
        tok,
        policy=policy,
        max_num_seqs=64,
        max_num_batched_tokens=budget,
        kv_cache_bytes=kv_bytes_for(model.cfg, work),
    )
    params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for _, o in work]
    # Untimed: first calls pay one-time costs (kernel load, thread pool, allocator), which
    # would otherwise land on whichever policy runs first.
    llm.generate([p for p, _ in work[:2]], params[:2])
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in work], params)
    wall = time.perf_counter() - t0
    itl = [g for o in outs for g in o.timings.inter_token_s]
    ttft = [o.timings.ttft_s for o in outs if o.timings.ttft_s is not None]
    tokens = sum(len(o.token_ids) for o in outs)
    return {
        "policy": policy,
        "output_tok_per_s": tokens / wall,
        "wall_s": wall,
        "ttft_p50_s": _pct(ttft, 0.5),
        "ttft_p99_s": _pct(ttft, 0.99),
        "itl_p50_s": _pct(itl, 0.5),
        "itl_p99_s": _pct(itl, 0.99),
    }


def run_transformers(model: Transformer, work, batched: bool) -> dict | None:
    hf = hf_llama(model)  # the same weights in transformers' Llama
    if hf is None:
        return None
    t0 = time.perf_counter()
    tokens = 0
    with torch.inference_mode():
        if batched:
            width = max(len(p) for p, _ in work)
            ids = torch.zeros(len(work), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, (p, _) in enumerate(work):
                ids[i, width - len(p) :] = torch.tensor(p)
                mask[i, width - len(p) :] = 1
            max_new = max(o for _, o in work)
            hf.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                do_sample=False,
                min_new_tokens=max_new,
            )
            tokens = sum(o for _, o in work)  # useful tokens; the padding rows' extras are waste
        else:
            for p, o in work:
                hf.generate(
                    input_ids=torch.tensor([p]), max_new_tokens=o, min_new_tokens=o, do_sample=False
                )
                tokens += o
    wall = time.perf_counter() - t0
    return {
        "policy": "transformers-" + ("batched" if batched else "sequential"),
        "output_tok_per_s": tokens / wall,
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--preset", default="base-125m")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-range", type=int, nargs=2, default=(128, 1024))
    ap.add_argument("--output-range", type=int, nargs=2, default=(64, 256))
    ap.add_argument("--budget", type=int, default=512, help="chunked token budget per step")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: proves the script runs")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--out", default="bench/results/engine_throughput.json")
    args = ap.parse_args()
    if args.quick:
        args.prompt_range, args.output_range = (8, 64), (4, 16)
    torch.manual_seed(0)
    tok = Tokenizer.default()
    cfg = ModelConfig.from_name(args.preset)
    model = Transformer(cfg).eval()
    work = workload(
        args.requests, tuple(args.prompt_range), tuple(args.output_range), cfg.vocab_size
    )
    budget_mixed = max(args.prompt_range[1], args.budget) * 2
    rows = [
        run_engine(model, tok, work, "mixed", budget_mixed),
        run_engine(model, tok, work, "chunked", args.budget),
    ]
    if not args.skip_hf:
        rows += [
            r
            for r in (run_transformers(model, work, False), run_transformers(model, work, True))
            if r
        ]
    by = {r["policy"]: r for r in rows}
    heads = ("tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99")
    print(f"{'policy':24s} " + " ".join(f"{h:>9s}" for h in heads))
    for r in rows:
        print(
            f"{r['policy']:24s} {r['output_tok_per_s']:9.1f} "
            + " ".join(
                f"{r.get(k, float('nan')) * 1e3:8.1f}ms"
                for k in ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s")
            )
        )
    ratios = {
        "chunked_vs_mixed_throughput": by["chunked"]["output_tok_per_s"]
        / by["mixed"]["output_tok_per_s"],
        "mixed_vs_chunked_itl_p99": by["mixed"]["itl_p99_s"] / by["chunked"]["itl_p99_s"],
    }
    if "transformers-sequential" in by:
        ratios["chunked_vs_transformers_sequential"] = (
            by["chunked"]["output_tok_per_s"] / by["transformers-sequential"]["output_tok_per_s"]
        )
        ratios["chunked_vs_transformers_batched"] = (
            by["chunked"]["output_tok_per_s"] / by["transformers-batched"]["output_tok_per_s"]
        )
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "args": vars(args),
                "rows": rows,
                "ratios": ratios,
                "threads": torch.get_num_threads(),
            },
            indent=2,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
