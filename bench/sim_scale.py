"""Simulator speed: simulated requests per wall second, and how it grows with requests/replicas.

The cluster is chunked-prefill replicas (llama-3.1-8b on h100-sxm, one GPU each, least-loaded
routing) fed the `chat` preset at 5 requests/s per replica, so every replica stays busy with
a batch of a few dozen sequences. Each step runs the engine's real Scheduler and BlockManager;
runs of identical decode-only steps are fast-forwarded (`sim.replica`; the same results, which
`--no-fast-forward` checks by stepping every decode through the scheduler).

    OMP_NUM_THREADS=1 python bench/sim_scale.py            # the grid, then the 100k x 64 target
    OMP_NUM_THREADS=1 python bench/sim_scale.py --quick    # small grid only (CI)
    OMP_NUM_THREADS=1 python bench/sim_scale.py --no-fast-forward   # every step scheduled
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from splitphase.engine.scheduler import SchedulerConfig
from splitphase.hardware.specs import get_hardware
from splitphase.model.config import ModelConfig
from splitphase.sim.cluster import ClusterConfig, PoolConfig
from splitphase.sim.cost_model import CostModel
from splitphase.sim.simulator import simulate
from splitphase.sim.workload import PRESETS

RATE_PER_REPLICA = 5.0
TARGET = (100_000, 64, 60.0)  # requests, replicas, seconds on 2 cores (issue #6)


def run(requests: int, replicas: int, fast_forward: bool = True) -> dict[str, float]:
    """One simulation; its wall time and throughput figures."""
    cfg, hw = ModelConfig.from_name("llama-3.1-8b"), get_hardware("h100-sxm")
    sched = SchedulerConfig(policy="chunked", max_num_seqs=256, max_num_batched_tokens=2048,
                            num_blocks=CostModel(cfg, hw).num_kv_blocks(16),
                            enable_prefix_caching=False)
    cluster = ClusterConfig(colocated=PoolConfig(replicas, 1, sched))
    reqs = PRESETS["chat"].with_rate(RATE_PER_REPLICA * replicas).generate(requests, 0, 32768)
    t0 = time.perf_counter()
    res = simulate(cluster, cfg, hw, reqs, fast_forward=fast_forward)
    wall = time.perf_counter() - t0
    steps = sum(r.num_steps for r in res.replicas)
    tokens = sum(r.output_len for r in res.records)
    return {"requests": requests, "replicas": replicas, "wall_s": wall,
            "sim_requests_per_wall_s": requests / wall, "steps": steps,
            "output_tokens": tokens, "simulated_s": res.makespan_s, "events": res.events,
            "us_per_token": wall / tokens * 1e6}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small grid, no target run")
    ap.add_argument("--no-fast-forward", action="store_true",
                    help="schedule every decode step (slower; the same results)")
    ap.add_argument("--out", default="bench/results/sim_scale.json")
    args = ap.parse_args(argv)
    grid = ([(500, 1), (1000, 2), (2000, 4)] if args.quick
            else [(2000, 1), (10_000, 1), (10_000, 8), (10_000, 64), (30_000, 64)])
    if not args.quick:
        grid.append(TARGET[:2])
    rows = []
    print(f"{'requests':>9} {'replicas':>8} {'wall s':>8} {'req/wall s':>11} {'steps':>9}"
          f" {'us/token':>9}")
    for n, k in grid:
        r = run(n, k, fast_forward=not args.no_fast_forward)
        rows.append(r)
        print(f"{n:>9,} {k:>8} {r['wall_s']:>8.1f} {r['sim_requests_per_wall_s']:>11,.0f}"
              f" {r['steps']:>9,} {r['us_per_token']:>9.2f}", flush=True)
    doc: dict[str, object] = {"bench": "sim_scale", "rate_per_replica": RATE_PER_REPLICA,
                              "workload": "chat", "fast_forward": not args.no_fast_forward,
                              "rows": rows}
    if not args.quick:
        last = rows[-1]
        doc["target"] = {"requests": TARGET[0], "replicas": TARGET[1], "limit_s": TARGET[2],
                         "wall_s": last["wall_s"], "met": last["wall_s"] < TARGET[2]}
        verdict = "met" if last["wall_s"] < TARGET[2] else "NOT met"
        print(f"target: {TARGET[0]:,} requests x {TARGET[1]} replicas in {last['wall_s']:.1f} s"
              f" (goal < {TARGET[2]:.0f} s): {verdict}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
