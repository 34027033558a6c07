"""The prefill's element-wise passes alone, native against torch, side by side in one process:
SiLU*mul (`silu_mul_`), the residual add with the RMSNorm after it (`add_rms_norm_`) and RoPE
on the queries, at a preset's widths and each row count; each figure the best of the rounds,
native and torch alternating, in GB/s of the tensors each pass must read and write (so a
figure near the triad's is a pass at the memory's speed) and the torch time over the native
one. Inputs are fresh copies each round, as the prefill hands over a GEMM's output. Nothing
is asserted.

    OMP_NUM_THREADS=2 python bench/elementwise_rates.py --dtype bfloat16 --rows 512 2048
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from splitphase.hardware.memory import keep_freed_memory
from splitphase.kernels import elementwise
from splitphase.model.config import ModelConfig
from splitphase.model.layers import rope_cos_sin

Setup = Callable[[], tuple[torch.Tensor, ...]]
Pass = tuple[Callable[..., object], Callable[..., object], Setup, int]


def best_s(fn: Callable[..., object], setup: Setup, rounds: int) -> float:
    best = math.inf
    for _ in range(rounds):
        args = setup()
        t0 = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - t0)
    return best


def _rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def passes(cfg: ModelConfig, rows: int, dtype: torch.dtype) -> dict[str, Pass]:
    """name -> (native, torch, setup, bytes read and written)."""
    g = torch.Generator().manual_seed(0)
    d, f, item = cfg.d_model, cfg.d_ff, torch.tensor([], dtype=dtype).element_size()

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    gate, up = randn(rows, f), randn(rows, f)
    x, r, w = randn(rows, d), randn(rows, d), torch.ones(d, dtype=dtype)
    q = randn(1, rows, cfg.n_heads, cfg.head_dim)
    cos, sin = rope_cos_sin(torch.arange(rows)[None], cfg.head_dim, cfg.rope_theta, dtype)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    eps = cfg.norm_eps

    def torch_norm(a: torch.Tensor, b: torch.Tensor) -> object:
        s = a + b
        s32 = s.float()
        return s, w * (s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)

    return {
        "silu_mul": (elementwise.silu_mul_, lambda a, b: F.silu(a) * b,
                     lambda: (gate.clone(), up), 3 * rows * f * item),
        "add_rms_norm": (lambda a, b: elementwise.add_rms_norm_(a, b, w, eps), torch_norm,
                         lambda: (x, r.clone()), 4 * rows * d * item),
        "rope_q": (lambda a: elementwise.rope(a, cos, sin), lambda a: _rotate_half(a, cos, sin),
                   lambda: (q.clone(),), 2 * q.numel() * item),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="base-125m")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rows", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    keep_freed_memory()
    cfg, dtype = ModelConfig.from_name(args.preset), getattr(torch, args.dtype)
    print(f"{args.preset} {args.dtype}, {torch.get_num_threads()} threads")
    with torch.inference_mode():
        for rows in args.rows:
            cells = []
            for name, (native, reference, setup, nbytes) in passes(cfg, rows, dtype).items():
                ours_s = theirs_s = math.inf
                for _ in range(2):  # alternate, so a slow spell hits both
                    ours_s = min(ours_s, best_s(native, setup, args.rounds))
                    theirs_s = min(theirs_s, best_s(reference, setup, args.rounds))
                cells.append(f"{name} {1e3 * ours_s:.3f} ms {nbytes / ours_s / 1e9:.1f} GB/s "
                             f"(torch {theirs_s / ours_s:.2f}x)")
            print(f"{rows:5d} rows | " + " | ".join(cells))


if __name__ == "__main__":
    main()
