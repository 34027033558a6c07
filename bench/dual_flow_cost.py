"""Dual-Flow cost evidence (issue 8): measured times next to the audit's FLOPs and bytes.

On one geometry with random weights (default `base-125m`), CPU, per dtype (fp32, bf16):
- decode step time at batch 1 and 8 after prefilling a random `--context`-token prompt, median
  of repeats: the baseline `Transformer`, the Dual-Flow model with the aux flow off
  (`aux_enabled = False`, P = p), on and grouped (`decode_step`: one matmul per shared weight for
  both flows' rows), and on as two separate passes (`decode_step_separate`);
- prefill time of one prompt, aux on vs off (the aux runs at the last position only);
- KV cache bytes per token: the baseline's and the Dual-Flow model's `cache.nbytes`, and
  `audit.flops.kv_bytes_per_token` (all three must be equal, exactly);
- next to each ratio, the analytical FLOP and byte ratios from `audit.flops` (decode FLOPs about
  2x, bytes about 1x); for MoE, `--moe-preset` rows from the formulas alone: replay routing reads
  no extra expert bytes, independent routing reads the union of both flows' experts.
Modes are timed interleaved (one step of each in turn) so a noisy machine biases none of them.
Times are printed, never asserted.

    python bench/dual_flow_cost.py                    # base-125m, fp32 + bf16, context 512
    python bench/dual_flow_cost.py --dtypes float32 --batches 1
    python bench/dual_flow_cost.py --quick            # tiny, context 64, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from splitphase.audit.flops import (
    decode_bytes,
    decode_flops,
    expected_distinct_experts,
    kv_bytes_per_token,
    prefill_bytes,
    prefill_flops,
)
from splitphase.model.attention_context import KVCache
from splitphase.model.config import ModelConfig
from splitphase.model.dual_flow import DualFlowTransformer
from splitphase.model.transformer import Transformer

DEFAULT_OUT = Path("bench/results/dual_flow_cost.json")
QUICK_OUT = Path("bench/results/dual_flow_cost_quick.json")
DECODE_MODES = ("baseline", "off", "grouped", "separate")
PREFILL_MODES = ("baseline", "off", "on")


def build_models(cfg: ModelConfig, seed: int) -> tuple[Transformer, DualFlowTransformer]:
    """The baseline and its Dual-Flow twin; the same seed gives the primary the same weights."""
    torch.manual_seed(seed)
    base = Transformer(cfg.with_(arch="baseline")).eval()
    torch.manual_seed(seed)
    df = DualFlowTransformer(cfg.with_(arch="dual_flow")).eval()
    return base, df


def clone_cache(model: Transformer, cache: KVCache) -> KVCache:
    """A copy of a prefilled cache, so every mode decodes from the same state."""
    new = model.new_cache(cache.k.shape[1], cache.max_len)
    new.k.copy_(cache.k)
    new.v.copy_(cache.v)
    new.length = cache.length
    return new


def timed(fn: Callable[[], Any]) -> float:
    """Wall seconds of one call."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved(calls: dict[str, Callable[[], Any]], repeats: int, warmup: int) -> dict[str, float]:
    """Median seconds per call, timing one call of each in turn (order rotated every round)."""
    names = list(calls)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + repeats):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            t = timed(calls[name])
            if r >= warmup:
                times[name].append(t)
    return {n: statistics.median(ts) for n, ts in times.items()}


def decode_calls(base: Transformer, df: DualFlowTransformer, batch: int,
                 context: int, steps: int) -> dict[str, Callable[[], Any]]:
    """One decode step per mode, each on its own copy of the same prefilled cache."""
    prompt = torch.randint(0, base.cfg.vocab_size, (batch, context))
    base_cache = base.new_cache(batch, context + steps)
    base.prefill(prompt, base_cache)
    df_cache = df.new_cache(batch, context + steps)
    df.prefill(prompt, df_cache)
    caches = {m: clone_cache(df, df_cache) for m in ("off", "grouped", "separate")}
    ids = torch.randint(0, base.cfg.vocab_size, (batch,))

    def step(mode: str) -> Callable[[], Any]:
        def run() -> Any:
            df.aux_enabled = mode != "off"
            fn = df.decode_step_separate if mode == "separate" else df.decode_step
            return fn(ids, caches[mode])
        return run

    calls: dict[str, Callable[[], Any]] = {"baseline": lambda: base.decode_step(ids, base_cache)}
    calls.update({m: step(m) for m in ("off", "grouped", "separate")})
    return calls


def prefill_calls(base: Transformer, df: DualFlowTransformer,
                  context: int) -> dict[str, Callable[[], Any]]:
    """One prefill of the same prompt (batch 1) per mode, each into its emptied cache."""
    prompt = torch.randint(0, base.cfg.vocab_size, (1, context))

    def run(model: Transformer, aux: bool) -> Callable[[], Any]:
        cache = model.new_cache(1, context)  # allocated once, outside the timed call

        def call() -> Any:
            df.aux_enabled = aux
            cache.length = 0  # prefill overwrites every position it attends to
            return model.prefill(prompt, cache)
        return call

    return {"baseline": run(base, False), "off": run(df, False), "on": run(df, True)}


def kv_bytes(base: Transformer, df: DualFlowTransformer, dtype_bytes: int,
             context: int) -> dict[str, Any]:
    """KV bytes per token: both caches after the same prefill, and the audit's formula."""
    prompt = torch.randint(0, base.cfg.vocab_size, (1, context))
    _, base_cache = base.prefill(prompt, base.new_cache(1, context))
    df.aux_enabled = True
    _, df_cache = df.prefill(prompt, df.new_cache(1, context))
    out = {
        "baseline_cache_bytes_per_token": base_cache.nbytes // context,
        "dual_flow_cache_bytes_per_token": df_cache.nbytes // context,
        "audit_kv_bytes_per_token": kv_bytes_per_token(df.cfg, dtype_bytes),
    }
    out["exactly_equal"] = len(set(out.values())) == 1 and base_cache.nbytes == df_cache.nbytes
    return out


# ---------------------------------------------------------------- analytical (audit.flops)


def analytical(cfg: ModelConfig, batch: int, context: int, dtype_bytes: int) -> dict[str, float]:
    """Decode (batch of `batch` at `context`) and prefill (one prompt) FLOPs and bytes."""
    base, df = cfg.with_(arch="baseline"), cfg.with_(arch="dual_flow")
    lens = [context] * batch
    out: dict[str, float] = {}
    for tag, c in (("baseline", base), ("dual_flow", df)):
        out[f"decode_flops_{tag}"] = decode_flops(c, lens)
        out[f"decode_bytes_{tag}"] = decode_bytes(c, lens, dtype_bytes)
        out[f"prefill_flops_{tag}"] = prefill_flops(c, context)
        out[f"prefill_bytes_{tag}"] = prefill_bytes(c, context, dtype_bytes=dtype_bytes)
    # Two separate passes read the weights and the cached KV a second time (minus W_k, W_v,
    # which the aux skips) and write no more KV: an estimate, audit.flops models grouped only.
    kv_write = kv_bytes_per_token(cfg, dtype_bytes) * batch
    kv_proj = dtype_bytes * cfg.n_layers * 2 * cfg.d_model * cfg.kv_dim
    out["decode_bytes_separate_estimate"] = (
        out["decode_bytes_dual_flow"] + out["decode_bytes_baseline"] - kv_write - kv_proj
    )
    return out


def moe_formula_rows(moe: ModelConfig, batches: list[int], context: int,
                     dtype_bytes: int) -> list[dict[str, Any]]:
    """MoE decode from the formulas: experts touched per layer and the bytes they cost."""
    expert_bytes = dtype_bytes * 3 * moe.d_model * moe.d_expert * moe.n_layers
    base = moe.with_(arch="baseline")
    variants = {
        f"independent k1={moe.top_k} k2={moe.top_k}": moe.with_(arch="dual_flow"),
        f"replay k1={moe.top_k}": moe.with_(arch="dual_flow", aux_routing="replay"),
    }
    rows = []
    for batch in batches:
        lens = [context] * batch
        e_base = expected_distinct_experts(base, batch)
        for label, df in variants.items():
            e_df = expected_distinct_experts(df, batch, batch)
            rows.append({
                "preset": moe.name, "batch": batch, "routing": label,
                "decode_flops_ratio": decode_flops(df, lens) / decode_flops(base, lens),
                "decode_bytes_ratio": decode_bytes(df, lens, dtype_bytes)
                / decode_bytes(base, lens, dtype_bytes),
                "experts_per_layer_baseline": e_base, "experts_per_layer_dual_flow": e_df,
                "extra_expert_bytes": (e_df - e_base) * expert_bytes,
            })
    return rows


# ---------------------------------------------------------------- one dtype


def measure_dtype(cfg: ModelConfig, dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    """Every measurement of one dtype, with the matching analytical figures."""
    c = cfg.with_(dtype=dtype)
    base, df = build_models(c, args.seed)
    out: dict[str, Any] = {"dtype": dtype, "decode": [], "prefill": None, "kv": None}
    for batch in args.batches:
        print(f"  {dtype} decode batch {batch}: {args.repeats} interleaved steps per mode",
              flush=True)
        calls = decode_calls(base, df, batch, args.context, args.repeats + args.warmup)
        median_s = interleaved(calls, args.repeats, args.warmup)
        out["decode"].append({"batch": batch, "median_s": median_s,
                              **analytical(c, batch, args.context, c.dtype_bytes)})
    print(f"  {dtype} prefill {args.context} tokens: {args.prefill_repeats} per mode", flush=True)
    median_s = interleaved(prefill_calls(base, df, args.context), args.prefill_repeats, 1)
    out["prefill"] = {"batch": 1, "tokens": args.context, "median_s": median_s,
                      **analytical(c, 1, args.context, c.dtype_bytes)}
    out["kv"] = kv_bytes(base, df, c.dtype_bytes, args.context)
    return out


# ---------------------------------------------------------------- table


def comparison_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The table's rows for one dtype: reference, Dual-Flow, measured and analytical ratios."""
    rows = []
    for d in res["decode"]:
        t, b = d["median_s"], d["batch"]
        f_base, f_df = d["decode_flops_baseline"], d["decode_flops_dual_flow"]
        b_base, b_df = d["decode_bytes_baseline"], d["decode_bytes_dual_flow"]
        b_sep = d["decode_bytes_separate_estimate"]
        rows += [
            _cmp(res, b, "decode step ms: aux on (grouped) / off", t["off"], t["grouped"],
                 (f_base, f_df), (b_base, b_df)),
            _cmp(res, b, "decode step ms: separate / grouped (bytes est.)", t["grouped"],
                 t["separate"], (f_df, f_df), (b_df, b_sep)),
            _cmp(res, b, "decode step ms: aux off / baseline", t["baseline"], t["off"],
                 (f_base, f_base), (b_base, b_base)),
        ]
    p, t = res["prefill"], res["prefill"]["median_s"]
    rows.append(_cmp(res, 1, f"prefill {p['tokens']} tok ms: aux on / off", t["off"], t["on"],
                     (p["prefill_flops_baseline"], p["prefill_flops_dual_flow"]),
                     (p["prefill_bytes_baseline"], p["prefill_bytes_dual_flow"])))
    kv = res["kv"]
    ref, df = kv["baseline_cache_bytes_per_token"], kv["dual_flow_cache_bytes_per_token"]
    same = "exactly equal" if kv["exactly_equal"] else "NOT EQUAL"
    rows.append({"dtype": res["dtype"], "batch": "-",
                 "what": "KV bytes/token: dual-flow / baseline", "ref": f"{ref:,}",
                 "dual_flow": f"{df:,}", "measured": f"{df / ref:.2f}x",
                 "flops": "-", "bytes": f"audit {kv['audit_kv_bytes_per_token']:,}: {same}",
                 "rate": "-"})
    return rows


def _cmp(res: dict[str, Any], batch: int, what: str, ref_s: float, df_s: float,
         flops: tuple[float, float], by: tuple[float, float]) -> dict[str, Any]:
    """One timed comparison; flops and by are (reference, Dual-Flow) from audit.flops."""
    rate = f"{flops[1] / df_s / 1e9:.1f} GFLOP/s, {by[1] / df_s / 1e9:.2f} GB/s"
    return {"dtype": res["dtype"], "batch": str(batch), "what": what, "ref": f"{1e3 * ref_s:.2f}",
            "dual_flow": f"{1e3 * df_s:.2f}", "measured": f"{df_s / ref_s:.2f}x",
            "flops": f"{flops[1] / flops[0]:.2f}x", "bytes": f"{by[1] / by[0]:.2f}x",
            "rate": rate}


def moe_table_rows(moe_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Formula-only MoE rows in the same table's columns."""
    return [{"dtype": "formula", "batch": str(r["batch"]),
             "what": f"{r['preset']} decode, {r['routing']} / MoE baseline",
             "ref": f"{r['experts_per_layer_baseline']:.2f} exp", "measured": "-",
             "dual_flow": f"{r['experts_per_layer_dual_flow']:.2f} exp",
             "flops": f"{r['decode_flops_ratio']:.2f}x",
             "bytes": f"{r['decode_bytes_ratio']:.2f}x",
             "rate": f"extra expert bytes {r['extra_expert_bytes']:,.0f}"} for r in moe_rows]


TABLE_COLS = (("dtype", "dtype"), ("batch", "B"), ("what", "comparison (Dual-Flow / reference)"),
              ("ref", "reference"), ("dual_flow", "dual-flow"), ("measured", "measured"),
              ("flops", "FLOPs (audit)"), ("bytes", "bytes (audit)"),
              ("rate", "dual-flow achieved / note"))


def print_table(rows: list[dict[str, Any]]) -> str:
    """Print (and return) the aligned side-by-side table."""
    head = [h for _, h in TABLE_COLS]
    body = [[str(r[k]) for k, _ in TABLE_COLS] for r in rows]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    text = "\n".join("  ".join(v.ljust(w) for v, w in zip(x, widths, strict=True))
                     for x in [head, *body])
    print(text)
    return text


# ---------------------------------------------------------------- command line


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="base-125m")
    p.add_argument("--moe-preset", default="tiny-moe", help="MoE rows, from the formulas only")
    p.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16"),
                   default=["float32", "bfloat16"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--context", type=int, default=512, help="prompt tokens before decoding")
    p.add_argument("--repeats", type=int, default=30, help="timed decode steps per mode")
    p.add_argument("--prefill-repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help=f"results JSON (default {DEFAULT_OUT})")
    p.add_argument("--quick", action="store_true", help="tiny, context 64: seconds")
    args = p.parse_args(argv)
    if args.quick:  # smoke-run values, for the options left at their defaults
        quick = {"preset": "tiny", "context": 64, "repeats": 5, "prefill_repeats": 2, "warmup": 1}
        for name, value in quick.items():
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, value)
    args.out = args.out or (QUICK_OUT if args.quick else DEFAULT_OUT)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = ModelConfig.from_name(args.preset)
    if args.context + args.repeats + args.warmup > cfg.max_seq_len:
        raise SystemExit(f"--context {args.context} plus the decode steps exceeds {args.preset}'s "
                         f"max_seq_len {cfg.max_seq_len}; pass a smaller --context")
    print(f"dual_flow_cost: {args.preset}, random weights, CPU ({platform.processor() or 'cpu'}), "
          f"torch threads {torch.get_num_threads()}, context {args.context}, medians of "
          f"{args.repeats} decode / {args.prefill_repeats} prefill repeats", flush=True)
    results = [measure_dtype(cfg, dtype, args) for dtype in args.dtypes]
    moe = ModelConfig.from_name(args.moe_preset)
    moe_rows = moe_formula_rows(moe, args.batches, args.context, 2)
    rows = [r for res in results for r in comparison_rows(res)] + moe_table_rows(moe_rows)
    table = print_table(rows)
    doc = {"bench": "dual_flow_cost", "preset": args.preset, "config": cfg.to_dict(),
           "context": args.context, "repeats": args.repeats,
           "prefill_repeats": args.prefill_repeats, "torch_threads": torch.get_num_threads(),
           "torch": torch.__version__, "machine": platform.machine(),
           "dtypes": results, "moe_formula": moe_rows, "table": rows, "table_text": table}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    os.replace(tmp, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
