"""Each form of a prefill linear (`splitphase.kernels.gemm_choice`) at a preset's shapes, by row
count, side by side: the packed GEMM, the same over equal row pieces of at most SPLIT_ROWS, and
torch's linear on the plain weight; GFLOP/s, best of the rounds, forms alternating, and which
one the timed choice would take (`gemm_choice.pick`). Nothing is asserted.

    OMP_NUM_THREADS=2 python bench/gemm_forms.py --dtype bfloat16 --rows 128 256 512 1024 2048
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from splitphase.hardware.memory import keep_freed_memory
from splitphase.kernels import gemm_choice, packed_linear
from splitphase.model.config import ModelConfig


def time_forms(x: torch.Tensor, w: torch.Tensor, rounds: int) -> dict[str, float]:
    """Best seconds of each form that applies at x's rows, the forms alternating."""
    pack = packed_linear.PackedWeight()
    forms = gemm_choice.candidates(x.shape[0])
    best = dict.fromkeys(forms, math.inf)
    for r in range(rounds + 1):  # round 0 warms up (packing, oneDNN's primitives), untimed
        for form in forms:
            with gemm_choice.forced(form):
                t0 = time.perf_counter()
                if packed_linear.linear(x, w, pack) is None:  # "torch": the caller's linear
                    torch.nn.functional.linear(x, w)
                if r:
                    best[form] = min(best[form], time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="base-125m")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--rows", type=int, nargs="+", default=[128, 256, 384, 512, 768, 1024, 2048])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    keep_freed_memory()
    cfg, dtype = ModelConfig.from_name(args.preset), getattr(torch, args.dtype)
    # The prefill's GEMMs: Q/K/V stacked as one, O, gate and up (one shape), down.
    d, qkv = cfg.d_model, cfg.q_dim + 2 * cfg.kv_dim
    shapes = [(qkv, d), (d, cfg.q_dim), (cfg.d_ff, d), (d, cfg.d_ff)]
    g = torch.Generator().manual_seed(0)
    print(f"{args.preset} {args.dtype}, {torch.get_num_threads()} threads, "
          f"backend {packed_linear.backend_for(dtype)}, split pieces <= {gemm_choice.SPLIT_ROWS}")
    with packed_linear.switched(True):
        for rows in args.rows:
            cells = []
            for out_f, in_f in shapes:
                x = torch.randn(rows, in_f, generator=g).to(dtype)
                w = torch.randn(out_f, in_f, generator=g).to(dtype)
                best = time_forms(x, w, args.rounds)
                rates = " ".join(f"{f} {2 * rows * in_f * out_f / s / 1e9:.0f}"
                                 for f, s in best.items())
                cells.append(f"{out_f}x{in_f}: {rates} -> {gemm_choice.pick(best)}")
            print(f"{rows:5d} rows | " + " | ".join(cells))


if __name__ == "__main__":
    main()
