"""Dual-Flow quality evidence (issue 8): held-out NLL of the decode-time prediction, N seeds.

Every row trains with `Trainer` on the prepared corpus (same data order per seed, so rows are
paired by seed) and is scored with `evaluate()` on the validation split: the mean NLL of the
teacher-forced log P, which equals the decode-time P at every prompt boundary (the aux flow at
t reads only x_t and primary states <= t; see splitphase.model.dual_flow), and the continuation
loss after natural prompt boundaries. Rows (the issue's numbering):

  1 baseline                       the primary flow alone: same prompt cost, same KV bytes
  2 dual-flow                      default fields; ablations coupling=none, readout=aux
  3 baseline-2x-tokens             2x the steps: about Dual-Flow's training FLOPs (printed)
  4 baseline-deeper (or -wider)    decode FLOPs/token equal to Dual-Flow's by audit.flops
  5 moe-*                          one expert pool; k1 in {1,2} x k2 in {1,2,4}, independent
                                   routing; replay (k2 = k1 by construction); an MoE baseline

Costs per row come from audit.flops (bf16 bytes, batch 1, context 512). Results go to a JSON
file after every seed; a rerun skips (row, seed) pairs already there, and an interrupted seed
resumes from its trainer state. Nothing is asserted; the last line says whether Dual-Flow beats
the baseline by more than two standard deviations.

    python bench/dual_flow_quality.py                       # small, 2500 steps, 3 seeds
    python bench/dual_flow_quality.py --rows baseline dual-flow --seeds 5
    python bench/dual_flow_quality.py --rows 'moe-*' --markdown
    python bench/dual_flow_quality.py --list                 # rows, geometry, costs; no training
    python bench/dual_flow_quality.py --quick                # tiny, 5 steps, seconds per row
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from splitphase.audit.flops import (
    decode_bytes,
    decode_flops,
    kv_bytes_per_token,
    param_count,
    prefill_flops,
    training_flops,
)
from splitphase.data.shards import load_meta, load_split, load_val_boundaries
from splitphase.model.config import ModelConfig
from splitphase.training.evaluate import evaluate
from splitphase.training.quality_report import (
    compact_si,
    markdown_table,
    summarize,
    text_table,
    verdict,
    verdict_line,
)
from splitphase.training.trainer import STATE_FILE, TrainConfig, Trainer

DEFAULT_OUT = Path("bench/results/dual_flow_quality.json")
DEFAULT_WORK = Path("runs/dual_flow_quality")
QUICK_OUT = Path("bench/results/dual_flow_quality_quick.json")  # never mixed with real results
QUICK_WORK = Path("runs/dual_flow_quality_quick")
MOE_EXPERTS, MOE_SHARED = 8, 1  # the `small-moe` pool: 8 routed experts of d_ff/4, 1 shared
SERVE_DTYPE_BYTES = 2  # costs are quoted for bf16 serving


@dataclass(frozen=True)
class Settings:
    """What every row shares; a results file is only resumed under the same settings."""

    preset: str
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    warmup_steps: int
    amp: str
    eval_tokens: int | None  # None: the whole validation split
    eval_prompts: int | None  # continuation prompts; None: evaluate()'s default (512)
    context: int  # context length of the per-token cost columns
    matched: str  # deeper | wider
    data: dict[str, Any]  # tokenizer sha256 and split sizes of the prepared corpus


@dataclass(frozen=True)
class Row:
    """One line of the evidence table."""

    name: str
    group: str  # the row number
    what: str
    cfg: ModelConfig
    steps: int


# ---------------------------------------------------------------- geometry


def moe_pool(base: ModelConfig, k1: int) -> ModelConfig:
    """`small-moe`: the base geometry with an MoE MLP, MOE_EXPERTS routed + MOE_SHARED shared."""
    return base.with_(
        name=f"{base.name}-moe",
        n_experts=MOE_EXPERTS,
        d_expert=base.d_ff // 4,
        n_shared_experts=MOE_SHARED,
        top_k=k1,
    )


def matched_baseline(base: ModelConfig, target_flops: float, context: int, how: str) -> ModelConfig:
    """A baseline whose decode FLOPs/token at `context` match target_flops by audit.flops.

    deeper: the fewest layers reaching the target, then d_ff (multiple of 8) trimmed to it;
    wider: the same layers, d_ff (multiple of 8) grown to it.
    """

    def flops(cfg: ModelConfig) -> float:
        return decode_flops(cfg, [context])

    layers = base.n_layers
    if how == "deeper":
        while flops(base.with_(n_layers=layers)) < target_flops:
            layers += 1
    candidates = (
        base.with_(name=f"{base.name}-{how}", n_layers=layers, d_ff=d_ff)
        for d_ff in range(8, 16 * base.d_ff + 1, 8)
    )
    return min(candidates, key=lambda cfg: abs(flops(cfg) - target_flops))


def build_rows(base: ModelConfig, steps: int, context: int, matched: str) -> list[Row]:
    """The issue's rows 1-5 on the base geometry."""
    df = base.with_(arch="dual_flow")
    wide = matched_baseline(base, decode_flops(df, [context]), context, matched)
    rows = [
        Row("baseline", "1", "baseline (primary flow alone), same tokens", base, steps),
        Row("dual-flow", "2", "Dual-Flow dense, coupling=abc, readout=mix", df, steps),
        Row("dual-flow-coupling=none", "2", "ablation: coupling=none", df.with_(coupling="none"),
            steps),
        Row("dual-flow-readout=aux", "2", "ablation: readout=aux (P = q)",
            df.with_(readout="aux"), steps),
        Row("baseline-2x-tokens", "3", "baseline on 2x tokens (matched training FLOPs)", base,
            2 * steps),
        Row(f"baseline-{matched}", "4",
            f"baseline {wide.n_layers}L d_ff={wide.d_ff}: decode FLOPs of Dual-Flow", wide, steps),
    ]
    for k1 in (1, 2):
        pool = moe_pool(base, k1)
        rows.append(Row(f"moe-k1={k1}-baseline", "5", f"MoE baseline, k1={k1}", pool, steps))
        for k2 in (1, 2, 4):
            cfg = pool.with_(arch="dual_flow", aux_top_k=k2)
            rows.append(Row(f"moe-k1={k1}-k2={k2}-independent", "5",
                            f"MoE Dual-Flow, k1={k1} k2={k2}, independent routing", cfg, steps))
        cfg = pool.with_(arch="dual_flow", aux_routing="replay")
        what = f"MoE Dual-Flow, k1={k1}, replay (k2=k1, the primary's experts)"
        rows.append(Row(f"moe-k1={k1}-replay", "5", what, cfg, steps))
    return rows


def select_rows(rows: list[Row], patterns: list[str] | None) -> list[Row]:
    """Rows whose name matches any pattern (fnmatch), in table order; all when none given."""
    if not patterns:
        return rows
    names = [r.name for r in rows]
    for pattern in patterns:
        if not fnmatch.filter(names, pattern):
            raise SystemExit(f"--rows {pattern!r} matches no row; rows are: {', '.join(names)}")
    return [r for r in rows if any(fnmatch.fnmatch(r.name, p) for p in patterns)]


def row_cost(row: Row, s: Settings) -> dict[str, float]:
    """audit.flops figures for a row: serving (batch 1, bf16) and the row's training FLOPs."""
    cfg, ctx = row.cfg, s.context
    return {
        "params": param_count(cfg),
        "prefill_flops_per_token": prefill_flops(cfg, ctx) / ctx,
        "decode_flops_per_token": decode_flops(cfg, [ctx]),
        "decode_bytes_per_step": decode_bytes(cfg, [ctx], dtype_bytes=SERVE_DTYPE_BYTES),
        "kv_bytes_per_token": kv_bytes_per_token(cfg, SERVE_DTYPE_BYTES),
        "train_flops": training_flops(cfg, s.seq_len) * s.batch_size * row.steps,
        "train_tokens": s.batch_size * s.seq_len * row.steps,
    }


def describe_geometry(s: Settings) -> dict[str, str]:
    """One printed line per derived geometry: the matched baseline, the MoE pool, training cost."""
    by_name = {r.name: r for r in build_rows(base_of(s), s.steps, s.context, s.matched)}
    base, df = by_name["baseline"], by_name["dual-flow"]
    wide, pool = by_name[f"baseline-{s.matched}"], by_name["moe-k1=1-baseline"].cfg
    ctx = s.context
    target, got = decode_flops(df.cfg, [ctx]), decode_flops(wide.cfg, [ctx])
    train_ratio = training_flops(df.cfg, s.seq_len) / training_flops(base.cfg, s.seq_len)
    return {
        "base": f"{base.cfg.name}: {base.cfg.n_layers}L d_model={base.cfg.d_model} "
        f"heads={base.cfg.n_heads}/{base.cfg.n_kv_heads} d_ff={base.cfg.d_ff} "
        f"vocab={base.cfg.vocab_size}",
        "matched": f"baseline-{s.matched}: n_layers {base.cfg.n_layers} -> {wide.cfg.n_layers}, "
        f"d_ff {base.cfg.d_ff} -> {wide.cfg.d_ff}: decode FLOPs/token at context {ctx} "
        f"{compact_si(got)} vs Dual-Flow {compact_si(target)} ({100 * (got / target - 1):+.2f}%)",
        "moe": f"{pool.name}: {pool.n_experts} routed experts of width {pool.d_expert} + "
        f"{pool.n_shared_experts} shared of width {pool.d_expert}, router {pool.d_model}x"
        f"{pool.n_experts}, every layer MoE; k1 in {{1, 2}}, k2 in {{1, 2, 4}}",
        "training": f"Dual-Flow training FLOPs per sequence = {train_ratio:.3f}x the baseline's "
        f"(audit.flops.training_flops, seq_len {s.seq_len}); row 3 trains on 2.000x tokens",
    }


def base_of(s: Settings) -> ModelConfig:
    """The preset with the prepared corpus's vocabulary."""
    return ModelConfig.from_name(s.preset).with_(vocab_size=s.data["vocab_size"])


# ---------------------------------------------------------------- training one (row, seed)


def subsample(boundaries: np.ndarray, n: int | None) -> np.ndarray:
    """n evenly spaced prompt boundaries (all when n is None)."""
    if n is None or n >= len(boundaries):
        return boundaries
    return boundaries[np.linspace(0, len(boundaries) - 1, n).astype(np.int64)]


def train_config(row: Row, s: Settings, seed: int) -> TrainConfig:
    """The row's TrainConfig: the trainer defaults except what Settings fixes."""
    return TrainConfig(
        preset=s.preset,
        arch=row.cfg.arch,
        steps=row.steps,
        batch_size=s.batch_size,
        seq_len=s.seq_len,
        lr=s.lr,
        warmup_steps=s.warmup_steps,
        eval_interval=min(row.steps, 250),  # checkpoints state.pt for resuming
        # The trainer's own periodic eval is for its log only; the result is evaluate()'s.
        eval_max_tokens=min(16384, s.eval_tokens or 16384),
        seed=seed,
        amp=s.amp,
    )


def run_seed(row: Row, seed: int, s: Settings, data: dict[str, np.ndarray], work: Path,
             save_model: bool, progress: bool) -> dict[str, Any]:
    """Train one row with one seed (resuming its state if any) and score it with evaluate()."""
    out = work / row.name / f"seed{seed}"
    t0 = time.perf_counter()
    trainer = Trainer(train_config(row, s, seed), data["train"], data["val"], None, out,
                      model_cfg=row.cfg)
    resumed_at = trainer.step if trainer.resume() else 0
    summary = trainer.train(progress=progress)
    t_train = time.perf_counter() - t0
    res = evaluate(trainer.model, data["val"], data["boundaries"], s.seq_len,
                   max_tokens=s.eval_tokens)
    if save_model:
        trainer.save(summary)
    (out / STATE_FILE).unlink(missing_ok=True)  # ~12 bytes/param; the JSON holds the result
    return {
        "seed": seed,
        "loss": res.loss,
        "tokens": res.tokens,
        "continuation_loss": res.continuation_loss,
        "continuation_tokens": res.continuation_tokens,
        "train_wall_s": t_train,
        "eval_wall_s": time.perf_counter() - t0 - t_train,
        "resumed_at_step": resumed_at,
        "torch_threads": torch.get_num_threads(),
    }


# ---------------------------------------------------------------- results file


def load_results(path: Path, s: Settings, fresh: bool) -> dict[str, Any]:
    """The results so far, or a new document; refuses to mix runs of different settings."""
    if fresh or not path.exists():
        return {"bench": "dual_flow_quality", "settings": asdict(s), "rows": {}}
    doc = json.loads(path.read_text())
    if doc.get("settings") != json.loads(json.dumps(asdict(s))):
        raise SystemExit(
            f"{path} holds results of other settings ({doc.get('settings')}); pass --fresh to "
            "start over or --out to write elsewhere"
        )
    return dict(doc)


def save_results(path: Path, doc: dict[str, Any]) -> None:
    """Write atomically (a reader never sees half a file; *.tmp is git-ignored)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    os.replace(tmp, path)


def row_entry(doc: dict[str, Any], row: Row, s: Settings) -> dict[str, Any]:
    """The row's record in doc (created if new); its config must not have changed."""
    entry = doc["rows"].setdefault(row.name, {"seeds": {}})
    if entry.get("config", row.cfg.to_dict()) != row.cfg.to_dict():
        raise SystemExit(f"row {row.name}: its config changed since {entry['config']}; --fresh")
    entry.update(name=row.name, group=row.group, what=row.what, arch=row.cfg.arch,
                 config=row.cfg.to_dict(), steps=row.steps, cost=row_cost(row, s))
    return dict(entry)


# ---------------------------------------------------------------- command line


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--steps", type=int, default=2500, help="steps per row (row 3 runs 2x)")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per row")
    p.add_argument("--rows", nargs="+", metavar="NAME", help="row names or fnmatch patterns")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--amp", choices=("bf16", "none"), default="bf16")
    p.add_argument("--eval-tokens", type=int, help="validation tokens scored (default: all)")
    p.add_argument("--eval-prompts", type=int, help="continuation prompts (default: 512)")
    p.add_argument("--context", type=int, default=512, help="context of the cost columns")
    p.add_argument("--matched", choices=("deeper", "wider"), default="deeper", help="row 4")
    p.add_argument("--data-dir", help="prepared shards (default: the splitphase data dir)")
    p.add_argument("--out", type=Path, help=f"results JSON (default {DEFAULT_OUT}; {QUICK_OUT} "
                   "with --quick)")
    p.add_argument("--work-dir", type=Path, help=f"trainer state per run (default {DEFAULT_WORK})")
    p.add_argument("--save-models", action="store_true", help="keep each run's checkpoint")
    p.add_argument("--fresh", action="store_true", help="ignore results already in --out")
    p.add_argument("--list", action="store_true", help="print rows and costs, train nothing")
    p.add_argument("--markdown", action="store_true", help="also print the README table")
    p.add_argument("--quick", action="store_true", help="tiny, 5 steps, small eval: a smoke run")
    args = p.parse_args(argv)
    if args.quick:  # smoke-run values, for the options left at their defaults
        quick = {"preset": "tiny", "steps": 5, "batch_size": 4, "seq_len": 64,
                 "warmup_steps": 1, "eval_tokens": 1024, "eval_prompts": 16}
        for name, value in quick.items():
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, value)
    args.out = args.out or (QUICK_OUT if args.quick else DEFAULT_OUT)
    args.work_dir = args.work_dir or (QUICK_WORK if args.quick else DEFAULT_WORK)
    return args


def make_settings(args: argparse.Namespace) -> Settings:
    """Settings from the arguments and the prepared corpus's meta.json."""
    meta = load_meta(args.data_dir)
    data = {"tokenizer_sha256": meta["tokenizer"]["sha256"],
            "vocab_size": meta["tokenizer"]["vocab_size"],
            "train_tokens": meta["splits"]["train"]["tokens"],
            "val_tokens": meta["splits"]["val"]["tokens"]}
    max_seq = ModelConfig.from_name(args.preset).max_seq_len
    return Settings(args.preset, args.steps, args.batch_size, args.seq_len, args.lr,
                    args.warmup_steps, args.amp, args.eval_tokens, args.eval_prompts,
                    min(args.context, max_seq), args.matched, data)


def run_rows(rows: list[Row], args: argparse.Namespace, s: Settings, doc: dict[str, Any]) -> None:
    """Train and score every missing (row, seed), saving the results after each."""
    data = {"train": load_split(args.data_dir, "train"), "val": load_split(args.data_dir, "val"),
            "boundaries": subsample(load_val_boundaries(args.data_dir), s.eval_prompts)}
    for i, row in enumerate(rows, 1):
        entry = doc["rows"][row.name] = row_entry(doc, row, s)
        todo = [k for k in range(args.seeds) if str(k) not in entry["seeds"]]
        if not todo:
            print(f"[{i}/{len(rows)}] {row.name}: skipped, {args.seeds} seeds in {args.out}")
        for seed in todo:
            print(f"[{i}/{len(rows)}] {row.name} seed {seed}: {row.steps} steps ...", flush=True)
            res = run_seed(row, seed, s, data, args.work_dir, args.save_models, not args.quick)
            entry["seeds"][str(seed)] = res
            entry["summary"] = summarize(entry["seeds"])
            doc["verdict"] = verdict(doc)
            save_results(args.out, doc)
            cont = res["continuation_loss"]
            print(f"    val NLL {res['loss']:.4f}  cont. NLL "
                  f"{'-' if cont is None else f'{cont:.4f}'}  train {res['train_wall_s']:.1f} s  "
                  f"eval {res['eval_wall_s']:.1f} s", flush=True)
        entry["summary"] = summarize(entry["seeds"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    s = make_settings(args)
    rows = select_rows(build_rows(base_of(s), s.steps, s.context, s.matched), args.rows)
    geometry = describe_geometry(s)
    print(f"dual_flow_quality: {len(rows)} rows x {args.seeds} seeds, torch threads "
          f"{torch.get_num_threads()}, results -> {args.out}")
    for line in geometry.values():
        print(f"  {line}")
    doc = load_results(args.out, s, args.fresh)
    doc["geometry"] = geometry
    if args.list:  # shows what --out already holds, trains and writes nothing
        for row in rows:
            doc["rows"][row.name] = row_entry(doc, row, s)
    else:
        run_rows(rows, args, s, doc)
    doc["verdict"] = verdict(doc)
    if not args.list:
        save_results(args.out, doc)
    print(text_table(doc))
    if args.markdown:
        print("\n" + markdown_table(doc) + "\n")
    for ref, v in doc.get("verdict", {}).items():
        print(f"dual-flow vs {ref}: margin {v['margin']:+.4f} val NLL = {v['sds']:.1f} sd "
              f"(sd {v['sd']:.4f}){'' if v['beats_by_2sd'] else ', not beyond 2 sd'}")
    print(verdict_line(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
