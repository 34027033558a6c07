"""The skinny kernel's two AVX2 tiles side by side: outer products against dot products.

On a build without AVX-512 the kernel multiplies calls of `skinny.OUTER_MIN_ROWS` rows or more
with its outer-product tile (`skinny_outer_avx2.h`) and smaller ones with the 4 x 1 dot tile.
This times base-125m's layer linears (fused QKV, O, gate and up in one call, down; 12 layers
of distinct weights, so they come from memory as in a real step) with the outer tile on and
off in turn, in one process, best of `--repeats`, for each row count, and prints GFLOP/s per
linear and the dot tile's time over the outer tile's. Below OUTER_MIN_ROWS both sides run the
dot tile, so a row count there shows the run's noise. Nothing is asserted; on a build without
the tile it says so and stops.

    OMP_NUM_THREADS=2 python bench/outer_tile_ab.py --rows 8 12 16 32 48 64
"""

from __future__ import annotations

import argparse
import time

import torch

from splitphase.kernels import skinny
from splitphase.model.config import ModelConfig

MODES = {"dot": 0, "outer": skinny.OUTER_MIN_ROWS}


def _weights(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, list[list[torch.Tensor]]]:
    """Per linear, per layer, the weights one call takes."""
    d, f = cfg.d_model, cfg.d_ff
    shapes = {"qkv": [(cfg.q_dim + 2 * cfg.kv_dim, d)], "o": [(d, cfg.q_dim)],
              "gate_up": [(f, d), (f, d)], "down": [(d, f)]}
    return {name: [[(torch.randn(o, i) * 0.02).to(dtype) for o, i in parts]
                   for _ in range(cfg.n_layers)] for name, parts in shapes.items()}


def _time_s(x: torch.Tensor, layers: list[list[torch.Tensor]]) -> float:
    t0 = time.perf_counter()
    for ws in layers:
        torch.ops.splitphase.skinny_linear(x, ws, 0)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="base-125m")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 12, 16, 32, 48, 64])
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    if not skinny.outer_tile():
        print("this build has no outer-product tile (it is AVX2-only; AVX-512 builds use others)")
        return
    dtype = getattr(torch, args.dtype)
    cfg = ModelConfig.from_name(args.preset)
    weights = _weights(cfg, dtype)
    print(f"{args.preset} layer linears, {args.dtype}, {torch.get_num_threads()} threads; "
          "GFLOP/s dot -> outer")
    try:
        for rows in args.rows:
            best: dict[tuple[str, str], float] = {}
            for _ in range(args.repeats):
                for mode, from_rows in MODES.items():
                    torch.ops.splitphase.set_outer_min_rows(from_rows)
                    for name, layers in weights.items():
                        x = torch.randn(rows, layers[0][0].shape[1]).to(dtype)
                        s = _time_s(x, layers)
                        best[mode, name] = min(best.get((mode, name), s), s)
            parts = []
            for name, layers in weights.items():
                flops = 2 * rows * sum(w.numel() for ws in layers for w in ws)
                parts.append(f"{name} {flops / best['dot', name] / 1e9:.0f} -> "
                             f"{flops / best['outer', name] / 1e9:.0f}")
            total = {m: sum(best[m, n] for n in weights) for m in MODES}
            print(f"rows {rows:3d}: {', '.join(parts)}; all {total['dot'] * 1e3:.1f} -> "
                  f"{total['outer'] * 1e3:.1f} ms (dot/outer {total['dot'] / total['outer']:.2f})")
    finally:
        torch.ops.splitphase.set_outer_min_rows(skinny.OUTER_MIN_ROWS)


if __name__ == "__main__":
    main()
