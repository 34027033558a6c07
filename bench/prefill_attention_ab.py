"""Causal prefill attention alone, A/B in one process: the native kernel against torch's SDPA.

One layer's attention of a preset's geometry (base-125m: 12 query heads over 4 K/V heads of
64) at each prompt length, q (1, n, H, D) and k/v (1, n, G, D) in the layout the model hands
over, output (1, n, H*D) for o_proj; "sdpa" is the model's torch path (`sdpa_gqa`, torch's
CPU flash kernel with enable_gqa, plus the transpose back). A GEMM of the model's largest
linear at n rows, timed the same way, gives the machine's matmul rate for scale. In bf16 on
a CPU where the kernel multiplies on AMX tiles, "native-vdpbf16" is the kernel kept off them.
Variants alternate, each figure is the best round; FLOPs count causal pairs only,
4*H*D*n(n+1)/2. Nothing is asserted.

    OMP_NUM_THREADS=1 python bench/prefill_attention_ab.py --lengths 512 2048 --clock process
    OMP_NUM_THREADS=2 python bench/prefill_attention_ab.py --dtype bfloat16 --lengths 64 512
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from splitphase.kernels import prefill_attention
from splitphase.model.config import ModelConfig
from splitphase.model.layers import sdpa_gqa


def causal_attention_flops(heads: int, head_dim: int, n: int) -> int:
    """FLOPs of QK^T and PV over the n(n+1)/2 causal query-key pairs of one layer."""
    return 4 * heads * head_dim * n * (n + 1) // 2


def _variants(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, Callable[[], object]]:
    def native() -> object:
        # bf16 too, and scalar tiles (no AVX-512), even where SDPA takes them in the model
        with prefill_attention.bf16_switched(True), prefill_attention.scalar_tiles_allowed():
            out = prefill_attention.causal(q, k, v)
        assert out is not None, "the native kernel does not apply here (see kernels.build.status)"
        return out

    def vdpbf16() -> object:
        with prefill_attention.amx_switched(False):
            return native()

    def sdpa() -> object:
        out = sdpa_gqa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, True)
        return out.transpose(1, 2).flatten(2)  # (1, n, H*D), as Attention.attend returns it

    fns = {"native": native, "sdpa": sdpa}
    if q.dtype == torch.bfloat16 and prefill_attention.amx_tiles():
        fns["native-vdpbf16"] = vdpbf16
    return fns


def _best(fns: dict[str, Callable[[], object]], rounds: int, clock: Callable[[], float]) -> dict:
    best = {name: float("inf") for name in fns}
    for r in range(rounds + 1):  # round 0 warms up and is not kept
        for name, fn in fns.items():
            t0 = clock()
            fn()
            if r:
                best[name] = min(best[name], clock() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="base-125m")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--clock", choices=["wall", "process"], default="wall")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    cfg = ModelConfig.from_name(args.preset)
    h, g, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    print(f"threads {torch.get_num_threads()}, {args.clock} clock, {args.dtype}, H {h} G {g} "
          f"D {d}, load before {os.getloadavg()}")
    gen = torch.Generator().manual_seed(0)
    torch.set_grad_enabled(False)
    for n in args.lengths:
        q = torch.randn(1, n, h, d, generator=gen).to(dtype)
        k, v = (torch.randn(1, n, g, d, generator=gen).to(dtype) for _ in range(2))
        x = torch.randn(n, cfg.d_model, generator=gen).to(dtype)
        w = torch.randn(cfg.d_ff, cfg.d_model).to(dtype)
        fns = {**_variants(q, k, v), "gemm": lambda x=x, w=w: F.linear(x, w)}
        best = _best(fns, args.rounds, clock)
        flops = causal_attention_flops(h, d, n)
        gemm_rate = 2 * n * cfg.d_model * cfg.d_ff / best["gemm"]
        rates = {name: flops / best[name] for name in best if name != "gemm"}
        print(f"n {n}: " + ", ".join(
            f"{name} {1e3 * best[name]:.2f} ms {rates[name] / 1e9:.1f} GFLOP/s "
            f"({100 * rates[name] / gemm_rate:.0f}% of the GEMM)" for name in rates)
            + f"; sdpa/native {best['sdpa'] / best['native']:.2f}x; "
            f"GEMM {n}x{cfg.d_model}x{cfg.d_ff} {gemm_rate / 1e9:.1f} GFLOP/s")
    print(f"load after {os.getloadavg()}")


if __name__ == "__main__":
    main()
