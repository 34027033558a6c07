"""Decode step A/B in one process: the one-call native pass, the per-op native path, torch.

Variants alternate within each round (a busy spell on the shared machine hits all of them
alike) and each figure is the best step over all rounds. Prints ms per step, the bytes the
step must move over its time against the STREAM triad measured in the same run, ratios to
the fused pass, and the load average. Nothing is asserted.

    OMP_NUM_THREADS=2 python bench/decode_ab.py --batch 1 8 --dtypes float32 bfloat16
"""

from __future__ import annotations

import argparse
import os

import torch

from splitphase.kernels import decode_stack, skinny
from splitphase.model.config import ModelConfig
from splitphase.model.transformer import Transformer
from splitphase.perf.peaks import triad_bytes_per_s
from splitphase.perf.timing import time_decode

VARIANTS = {"fused": (True, True), "per_op": (True, False), "torch": (False, False)}


def _triad() -> float:
    return triad_bytes_per_s(torch.device("cpu"), 256, 8)  # as phase_limits measures it


def _set(variant: str) -> None:
    native, fused = VARIANTS[variant]
    skinny.set_enabled(native)
    decode_stack.set_enabled(fused)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="base-125m")
    ap.add_argument("--dtypes", nargs="+", default=["float32"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = ap.parse_args()
    print(f"threads {torch.get_num_threads()}, load before {os.getloadavg()}")
    triad = _triad()
    for name in args.dtypes:
        torch.manual_seed(0)
        model = Transformer(ModelConfig.from_name(args.preset).with_(dtype=name)).eval()
        for batch in args.batch:
            best: dict[str, float] = {}
            moved = 0.0
            for _ in range(args.rounds):
                for v in args.variants:
                    _set(v)
                    t = time_decode(model, batch, args.context, args.steps)
                    best[v], moved = min(best.get(v, t.step_s), t.step_s), t.bytes_per_step
                _set("fused")
                triad = max(triad, _triad())
            ref = best[args.variants[0]]
            print(f"{name} b{batch}: " + ", ".join(
                f"{v} {1e3 * s:.2f} ms ({100 * moved / s / triad:.0f}% triad, "
                f"{s / ref:.3f}x)" for v, s in best.items()))
    print(f"triad {triad / 1e9:.1f} GB/s (best of the run); load after {os.getloadavg()}")


if __name__ == "__main__":
    main()
