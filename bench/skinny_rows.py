"""The native skinny kernel against torch's linear by row count: where decode hands over.

A decode step multiplies one row per sequence by every weight. This times base-125m's MLP
linears (gate and up in one call, then down; 12 layers of distinct weights, so they come from
memory as in a real step) through the kernel and through torch, alternating, best of
`--repeats`, for each row count, and prints weight GB/s, GFLOP/s and torch's time over the
kernel's, and from `packed_linear.min_rows` rows the packed GEMM's time over the kernel's.
`skinny.MAX_ROWS` is the row count where torch's ratio falls to about 1, and
`packed_linear.ONEDNN_MIN_ROWS` where oneDNN's packed ratio does. Nothing is asserted.

    OMP_NUM_THREADS=2 python bench/skinny_rows.py --rows 1 4 8 16 32 48 64
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from splitphase.kernels import build, gemm_choice, packed_linear
from splitphase.kernels.packed_linear import PackedWeight
from splitphase.model.config import ModelConfig


def _best_s(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


Layer = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # gate, up, down


def _kernel(layers: list[Layer], x: torch.Tensor, h: torch.Tensor) -> None:
    for gate, up, down in layers:
        torch.ops.splitphase.skinny_linear(x, [gate, up])
        torch.ops.splitphase.skinny_linear(h, [down])


def _torch(layers: list[Layer], x: torch.Tensor, h: torch.Tensor) -> None:
    for gate, up, down in layers:
        F.linear(x, gate), F.linear(x, up), F.linear(h, down)


def _packed(packs: list[tuple[PackedWeight, ...]], layers: list[Layer], x: torch.Tensor,
            h: torch.Tensor) -> None:
    for (gate_p, up_p, down_p), (gate, up, down) in zip(packs, layers, strict=True):
        packed_linear.stacked_linear(x, [gate], gate_p), packed_linear.stacked_linear(x, [up], up_p)
        packed_linear.stacked_linear(h, [down], down_p)


def _row(layers: list[Layer], packs: list[tuple[PackedWeight, ...]] | None, rows: int,
         dtype: torch.dtype, repeats: int) -> dict[str, float]:
    """Best seconds of the kernel, torch and the packed GEMM at `rows`, alternating three times."""
    x = torch.randn(rows, layers[0][0].shape[1]).to(dtype)
    h = torch.randn(rows, layers[0][2].shape[1]).to(dtype)
    fns = {"kernel": partial(_kernel, layers, x, h), "torch": partial(_torch, layers, x, h)}
    if packs is not None and packed_linear.usable(x, layers[0][0]):
        fns["packed"] = partial(_packed, packs, layers, x, h)
    times = dict.fromkeys(fns, float("inf"))
    with torch.inference_mode(), gemm_choice.forced("packed"):  # else a call may time nothing
        for _ in range(3):  # a busy spell hits all
            for name, fn in fns.items():
                times[name] = min(times[name], _best_s(fn, repeats // 3 + 1))
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="base-125m")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 48, 64])
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    if not build.available():
        raise SystemExit(f"native kernels unavailable: {build.status().reason}")
    cfg = ModelConfig.from_name(args.preset)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    layers = [
        (torch.randn(cfg.d_ff, cfg.d_model).to(dtype), torch.randn(cfg.d_ff, cfg.d_model).to(dtype),
         torch.randn(cfg.d_model, cfg.d_ff).to(dtype))
        for _ in range(cfg.n_layers)
    ]
    weight_bytes = sum(w.numel() * w.element_size() for layer in layers for w in layer)
    weights = weight_bytes / torch.empty(0, dtype=dtype).element_size()
    gemm = packed_linear.backend_for(dtype)
    wide = packed_linear.widened_backend(dtype)  # bf16 widened to fp32 where none takes bf16
    packs = None if (gemm or wide) is None else [(PackedWeight(), PackedWeight(), PackedWeight())
                                                 for _ in layers]
    name = gemm or (f"{wide}, widened to fp32" if wide else "none")
    print(f"{args.preset} MLP linears, {args.dtype}, {torch.get_num_threads()} threads, "
          f"packed GEMM: {name} (from {packed_linear.min_rows(dtype)} rows)")
    print(f"{'rows':>5} {'kernel ms':>10} {'GB/s':>6} {'GFLOP/s':>8} {'torch ms':>9} "
          f"{'torch/kernel':>13} {'packed ms':>10} {'packed/kernel':>14}")
    for rows in args.rows:
        t = _row(layers, packs, rows, dtype, args.repeats)
        k_s, t_s, p_s = t["kernel"], t["torch"], t.get("packed")
        packed = "" if p_s is None else f" {p_s * 1e3:>10.1f} {p_s / k_s:>14.2f}"
        print(f"{rows:>5} {k_s * 1e3:>10.1f} {weight_bytes / k_s / 1e9:>6.1f} "
              f"{2 * rows * weights / k_s / 1e9:>8.0f} {t_s * 1e3:>9.1f} {t_s / k_s:>13.2f}"
              + packed)


if __name__ == "__main__":
    main()
