"""Simulator vs the real engine on this CPU: TTFT and TPOT p50 for workloads x policies.

Each run replays one Poisson/gamma arrival stream through the real engine (the embedded `small`
model, fp32, one torch thread; `disaggregated` runs the two worker processes) and records
every request's TTFT and TPOT as the client sees them. The cost model is then fitted to the
steps those runs executed (in-run calibration: pooled over the workloads, one fit for the
colocated engine, one for each disaggregated worker), and the simulator replays the same
arrivals and lengths through the engine's own Scheduler with those step costs, plus the
front-end hop and (disaggregated) the hand-off latency, both measured with idle two-token
requests before the run.

    OMP_NUM_THREADS=1 python bench/sim_validate.py [--quick] [--out FILE] [--requests N]
        [--rounds R] [--policies mixed chunked disaggregated]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from splitphase.audit.flops import step_cost
from splitphase.engine.llm import LLM
from splitphase.engine.sampling_params import SamplingParams
from splitphase.engine.scheduler import SchedulerConfig, SchedulerOutput
from splitphase.hardware.calibrate import calibrate
from splitphase.hardware.specs import HardwareSpec, LinkSpec
from splitphase.model.config import ModelConfig
from splitphase.sim.calibrate import StepSample, fit_efficiency
from splitphase.sim.cluster import ClusterConfig, PoolConfig
from splitphase.sim.cost_model import Efficiency
from splitphase.sim.simulator import simulate
from splitphase.sim.workload import SimRequest, parse_workload

WORKLOADS = {
    "short": ("poisson:8,prompt=uniform:16:64,output=fixed:32"),
    "long": ("poisson:3,prompt=uniform:300:600,output=fixed:16"),
    "bursty": ("gamma:5:2,prompt=lognormal:120:0.6,output=lognormal:24:0.4"),
}
POLICIES = ("mixed", "chunked", "disaggregated")
BLOCKS, BLOCK_SIZE, SEQS = 512, 16, 16
# A gap between two decode steps shorter than this is host work of a busy loop, not idling.
_BUSY_GAP_S = 2e-3
BUDGET = {"mixed": 1024, "chunked": 256, "disaggregated": 256}
# K/V between the two local worker processes goes through gloo over TCP loopback: bandwidth
# assumed (1 GB/s); the per-hand-off latency is the one measured by the idle probes.
LOOPBACK = LinkSpec("loopback", 1e9, 1e-3, "assumed: gloo over TCP loopback")


def engine_kwargs(policy: str) -> dict[str, Any]:
    return dict(policy=policy, max_num_seqs=SEQS, max_num_batched_tokens=BUDGET[policy],
                block_size=BLOCK_SIZE, num_blocks=BLOCKS)


def prompts_for(reqs: list[SimRequest], vocab: int) -> list[list[int]]:
    """Distinct in-vocabulary prompts of the drawn lengths (no accidental prefix hits)."""
    return [[(r.index * 7919 + j * 31) % (vocab - 3) + 2 for j in range(r.prompt_len)]
            for r in reqs]


def record_schedules(llm: LLM) -> list[tuple[SchedulerOutput, float]]:
    """Wrap a colocated engine's step to keep each step's SchedulerOutput and wall time."""
    engine: Any = llm.engine
    seen: list[tuple[SchedulerOutput, float]] = []
    orig_schedule, orig_step = engine.scheduler.schedule, engine.step
    last: list[SchedulerOutput] = []

    def schedule(now_s: float) -> SchedulerOutput:
        out = orig_schedule(now_s)
        last[:] = [out]
        return out

    def step() -> Any:
        t0 = time.perf_counter()
        result = orig_step()
        if last and last[0].num_seqs:
            seen.append((last[0], time.perf_counter() - t0))
        last.clear()
        return result

    engine.scheduler.schedule, engine.step = schedule, step
    return seen


def drive(llm: LLM, reqs: list[SimRequest], prompts: list[list[int]]) -> list[dict[str, float]]:
    """Open-loop replay: add each request at its arrival time; client-side token times."""
    engine: Any = llm.engine
    first: dict[str, float] = {}
    second: dict[str, float] = {}
    last: dict[str, tuple[float, int]] = {}
    arrival: dict[str, float] = {}
    t0, i = time.perf_counter(), 0
    while i < len(reqs) or engine.has_unfinished_requests():
        now = time.perf_counter()
        while i < len(reqs) and t0 + reqs[i].arrival_s <= now:
            rid, r = f"r{reqs[i].index}", reqs[i]
            arrival[rid] = t0 + r.arrival_s
            sp = SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
            engine.add_request(prompts[i], sp, request_id=rid, arrival_s=t0 + r.arrival_s)
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(0.005, t0 + reqs[i].arrival_s - now)))
            continue
        for out in engine.step():
            t = time.perf_counter()
            if out.token_ids:
                first.setdefault(out.request_id, t)
                if len(out.token_ids) >= 2:
                    second.setdefault(out.request_id, t)
                last[out.request_id] = (t, len(out.token_ids))
    rows = []
    for rid, t_first in first.items():
        t_last, n = last[rid]
        rows.append({"ttft_s": t_first - arrival[rid],
                     "tpot_s": (t_last - t_first) / (n - 1) if n > 1 else float("nan"),
                     "second_gap_s": second.get(rid, float("nan")) - t_first})
    return rows


def samples_colocated(seen: list[tuple[SchedulerOutput, float]]) -> list[StepSample]:
    return [StepSample(tuple((c.num_tokens, c.start) for c in o.prefill),
                       tuple(d.context_len - 1 for d in o.decode), wall) for o, wall in seen]


def samples_worker(cfg: ModelConfig, steps: list[Any], role: str, dtype_bytes: int
                   ) -> list[StepSample]:
    """Worker steps carry counts, FLOPs and bytes only: rebuild one chunk per step (its cached
    prefix from the KV bytes read) and the decodes' mean context.

    A step's time is its loop cadence (to the next step's start) when the loop went straight
    on: between steps a worker sends outputs to the front end and hands off (prefill) or adopts
    (decode) K/V, and every request queued behind it pays that too. A longer gap is the loop
    idling for work."""
    out = []
    mine = [s for s in steps if getattr(s, "role", None) == role and s.wall_s > 0]
    for s, nxt in zip(mine, [*mine[1:], None], strict=True):
        wall_s = s.wall_s
        if nxt is not None and s.started_s and nxt.started_s:
            gap_s = nxt.started_s - s.started_s - s.wall_s
            if 0 <= gap_s < _BUSY_GAP_S:
                wall_s += gap_s
        kv_tok = 2 * cfg.n_layers * cfg.kv_dim * dtype_bytes
        chunks: tuple[tuple[int, int], ...] = ()
        if s.num_prefill_tokens:  # cached tokens the chunk attends over, from its KV bytes
            n = s.num_prefill_tokens
            base = step_cost(cfg, [(n, 0)], [], dtype_bytes).bytes
            chunks = ((n, max(0, round((s.bytes - base) / kv_tok))),)
        ctx: tuple[int, ...] = ()
        if s.num_decode_seqs:
            n = s.num_decode_seqs
            base = step_cost(cfg, [], [0] * n, dtype_bytes).bytes
            ctx = (max(0, round((s.bytes - base) / (kv_tok * n))),) * n
        out.append(StepSample(chunks, ctx, wall_s))
    return out


def sched_config(policy: str, role: str | None, cfg: ModelConfig) -> SchedulerConfig:
    kw = engine_kwargs(policy)
    max_len = min(cfg.max_seq_len, BLOCKS * BLOCK_SIZE)
    if policy == "mixed":
        max_len = min(max_len, kw["max_num_batched_tokens"])
    return SchedulerConfig(policy=policy, role=role, max_num_seqs=SEQS,
                           max_num_batched_tokens=kw["max_num_batched_tokens"],
                           block_size=BLOCK_SIZE, num_blocks=BLOCKS, max_model_len=max_len)


def p50(rows: list[dict[str, float]], key: str) -> float:
    vals = [r[key] for r in rows if r[key] == r[key]]
    return statistics.median(vals) if vals else float("nan")


def mean(rows: list[dict[str, float]], key: str) -> float:
    """The mean as well as the p50: with a dozen requests a p50 can sit between two clusters
    (decodes that waited on another request's prefill and those that did not) and jump from
    one to the other when a step's timing moves a little; the mean moves with it smoothly."""
    vals = [r[key] for r in rows if r[key] == r[key]]
    return statistics.fmean(vals) if vals else float("nan")


def simulated(policy: str, cfg: ModelConfig, hw: HardwareSpec, reqs: list[SimRequest],
              effs: dict[str, Efficiency], hops: tuple[float, float]
              ) -> list[dict[str, float]]:
    """The fitted fractions are of `hw`'s peaks, so the replay must use that same spec (a
    fresh `calibrate` may re-measure the peaks and scale every step by the ratio)."""
    if policy == "disaggregated":
        cluster = ClusterConfig(
            prefill=PoolConfig(1, 1, sched_config(policy, "prefill", cfg), effs["prefill"]),
            decode=PoolConfig(1, 1, sched_config(policy, "decode", cfg), effs["decode"]),
            router="round_robin", dispatch_s=hops[0],
            link=replace(LOOPBACK, latency_s=max(LOOPBACK.latency_s, hops[1])))
    else:
        cluster = ClusterConfig(colocated=PoolConfig(1, 1, sched_config(policy, None, cfg),
                                                     effs["colocated"]), router="round_robin",
                                dispatch_s=hops[0])
    res = simulate(cluster, cfg, hw, reqs, dtype="float32", dtype_bytes=4)
    return [{"ttft_s": r.ttft_s, "tpot_s": r.tpot_s if r.tpot_s is not None else float("nan")}
            for r in res.records]


def measure_hop_s(llm: LLM, seen: list[tuple[SchedulerOutput, float]], vocab: int
                  ) -> tuple[float, float]:
    """Idle probes (8-token prompt, 2 tokens out), measured before the run: the front-end hop
    (TTFT minus the prefill step) and, for a disaggregated pair, the hand-off (first to
    second token minus the decode step: KV export, send, receive, adoption)."""
    ttfts, gaps, pre, dec = [], [], [], []
    for k in range(5):
        probe = [SimRequest(900 + k, 0.0, 8, 2)]
        row = drive(llm, probe, prompts_for(probe, vocab))[0]
        ttfts.append(row["ttft_s"])
        gaps.append(row["second_gap_s"])
        if seen:
            pre.append(next(w for o, w in reversed(seen) if o.prefill))
        else:
            steps = llm.engine.steps
            pre.append(next(s.wall_s for s in reversed(steps) if s.role == "prefill"))
            dec.append(next(s.wall_s for s in reversed(steps) if s.role == "decode"))
    hop = max(0.0, statistics.median(ttfts) - statistics.median(pre))
    handoff = max(0.0, statistics.median(gaps) - statistics.median(dec)) if dec else 0.0
    return hop, handoff


def run_policy(policy: str, streams: dict[str, list[SimRequest]], rounds: int = 1
               ) -> tuple[dict[str, list[dict[str, float]]], dict[str, list[StepSample]],
                          tuple[float, float]]:
    """Every workload through one engine of `policy`, `rounds` times over (the same arrivals
    each round): client rows pooled over the rounds, step samples, hops."""
    llm = LLM("small", device="cpu", **engine_kwargs(policy))
    cfg = ModelConfig.from_name("small") if llm.model is None else llm.model.cfg
    try:
        seen = [] if policy == "disaggregated" else record_schedules(llm)
        warm = parse_workload("poisson:50,prompt=fixed:64,output=fixed:4").generate(4, 9)
        drive(llm, warm, prompts_for(warm, cfg.vocab_size))  # first-call costs stay out
        hop_s, handoff_s = measure_hop_s(llm, seen, cfg.vocab_size)
        seen.clear()
        del llm.engine.steps[:]
        rows: dict[str, list[dict[str, float]]] = {name: [] for name in streams}
        for _ in range(rounds):  # workloads interleave: a slow spell of the machine is shared
            for name, reqs in streams.items():
                rows[name] += drive(llm, reqs, prompts_for(reqs, cfg.vocab_size))
        for name in streams:
            print(f"  {policy:13s} {name:7s} measured: TTFT p50 {p50(rows[name], 'ttft_s'):.4f}"
                  f" s, TPOT p50 {p50(rows[name], 'tpot_s'):.4f} s", flush=True)
        if policy == "disaggregated":
            samples = {role: samples_worker(cfg, llm.engine.steps, role, 4)
                       for role in ("prefill", "decode")}
        else:
            samples = {"colocated": samples_colocated(seen)}
    finally:
        llm.close()
    return rows, samples, (hop_s, handoff_s)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=80, help="requests per workload")
    ap.add_argument("--rounds", type=int, default=2,
                    help="replays of every workload, interleaved (measured rows pooled)")
    ap.add_argument("--quick", action="store_true", help="CI: 2 workloads x mixed, chunked")
    ap.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES),
                    help="policies to run (all by default)")
    ap.add_argument("--out", default="bench/results/sim_validate.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    workloads = dict(list(WORKLOADS.items())[:2]) if args.quick else WORKLOADS
    policies = POLICIES[:2] if args.quick else tuple(args.policies)
    n = 12 if args.quick else args.requests
    cfg = ModelConfig.from_name("small")
    streams = {k: parse_workload(v).generate(n, seed=3, max_len=cfg.max_seq_len)
               for k, v in workloads.items()}
    table, fits = [], {}
    hw = calibrate(quick=True)
    for policy in policies:
        rows, samples, hops = run_policy(policy, streams, 1 if args.quick else args.rounds)
        effs = {k: fit_efficiency(cfg, hw, v, source=f"fit to {len(v)} {k} steps")
                for k, v in samples.items()}
        fits[policy] = {**{k: e.to_dict() for k, e in effs.items()}, "hop_s": hops[0],
                        "handoff_s": hops[1]}
        for name, reqs in streams.items():
            sim = simulated(policy, cfg, hw, reqs, effs, hops)
            row = {"workload": name, "policy": policy, "requests": len(rows[name])}
            for key in ("ttft_s", "tpot_s"):
                real, pred = p50(rows[name], key), p50(sim, key)
                row[f"measured_{key}_p50"], row[f"simulated_{key}_p50"] = real, pred
                row[f"{key}_error"] = abs(pred - real) / real
                real, pred = mean(rows[name], key), mean(sim, key)
                row[f"measured_{key}_mean"], row[f"simulated_{key}_mean"] = real, pred
                row[f"{key}_mean_error"] = abs(pred - real) / real
            table.append(row)
            print(f"  {policy:13s} {name:7s} simulated: TTFT p50 {row['simulated_ttft_s_p50']:.4f}"
                  f" s ({row['ttft_s_error']:.0%}), TPOT p50 {row['simulated_tpot_s_p50']:.4f} s"
                  f" ({row['tpot_s_error']:.0%}); means' errors {row['ttft_s_mean_error']:.0%},"
                  f" {row['tpot_s_mean_error']:.0%}", flush=True)
    doc = {"bench": "sim_validate", "model": "small", "hardware": replace(hw).to_dict(),
           "workloads": workloads, "fits": fits, "rows": table,
           "within_20pct": sum(r["ttft_s_error"] <= 0.2 and r["tpot_s_error"] <= 0.2
                               for r in table), "runs": len(table)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"{doc['within_20pct']} of {len(table)} runs within 20% on both p50s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
