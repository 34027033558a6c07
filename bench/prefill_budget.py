"""Where a prefill's time goes: each kind of op's wall time inside the model's own pass.

Every call of the layer linears (torch's and the packed GEMM), the causal attention, the
fused element-wise passes and the LM head's last row is timed where the model makes it
(wrappers around those functions, perf_counter; a few microseconds a call), the rest is what
the pass spends outside them (Python, the embedding, K/V cache writes). The linears' own
rate (their FLOPs over their time) against the matmul peak measured in the same run says how
far the GEMMs alone are from it, and so how much of the gap to the peak is everything else.
Nothing is asserted.

    OMP_NUM_THREADS=2 python bench/prefill_budget.py --lengths 512 2048
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from splitphase.audit.flops import dense_linear_shapes, prefill_flops
from splitphase.hardware.memory import keep_freed_memory
from splitphase.kernels import elementwise, prefill_attention, skinny
from splitphase.model import layers
from splitphase.model.config import ModelConfig
from splitphase.model.transformer import Transformer
from splitphase.perf.peaks import matmul_peak_flops_per_s

# (module, function, part): the functions the model's prefill calls, by the part they are.
TIMED = [
    (F, "linear", "linears"),
    (torch.ops.mkl, "_mkl_linear", "linears"),
    (torch.ops.mkldnn, "_linear_pointwise", "linears"),
    (prefill_attention, "causal", "attention"),
    (layers, "sdpa_gqa", "attention"),  # where the native kernel does not apply (bf16)
    (elementwise, "silu_mul_", "silu_mul"),
    (elementwise, "add_rms_norm_", "add_rms_norm"),
    (elementwise, "rms_norm", "rms_norm"),
    (elementwise, "rope", "rope"),
    (skinny, "linear", "lm_head"),
]


@contextlib.contextmanager
def timed_parts(seconds: dict[str, float]) -> Iterator[None]:
    """Adds each TIMED function's wall time to seconds[part] inside the block."""
    real = [(mod, name, getattr(mod, name)) for mod, name, _ in TIMED]

    def wrap(fn: Callable[..., Any], part: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[part] += time.perf_counter() - t0

        return timed

    for (mod, name, fn), (_, _, part) in zip(real, TIMED, strict=True):
        setattr(mod, name, wrap(fn, part))
    try:
        yield
    finally:
        for mod, name, fn in real:
            setattr(mod, name, fn)


def budget(model: Transformer, n: int, rounds: int) -> tuple[float, dict[str, float]]:
    """(mean seconds of a prefill, mean seconds per part) over `rounds` after two warm-ups."""
    ids = torch.randint(0, model.cfg.vocab_size, (1, n))
    cache = model.new_cache(1, n)
    seconds: dict[str, float] = defaultdict(float)
    total = 0.0
    with torch.inference_mode(), timed_parts(seconds):
        for i in range(rounds + 2):
            if i == 2:
                seconds.clear()
                total = 0.0
            cache.length = 0
            t0 = time.perf_counter()
            model.prefill(ids, cache)
            total += time.perf_counter() - t0
    return total / rounds, {part: s / rounds for part, s in seconds.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="base-125m")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    keep_freed_memory()  # as the engine runs
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name(args.preset).with_(dtype=args.dtype)).eval()
    peak = matmul_peak_flops_per_s(model.cfg, model.dtype)["best"]
    print(f"{args.preset} {args.dtype}, {torch.get_num_threads()} threads, "
          f"matmul peak {peak / 1e9:.0f} GFLOP/s (best of the run)")
    for n in args.lengths:
        total_s, parts = budget(model, n, args.rounds)
        linear_flops = sum(2.0 * n * o * i * c for o, i, c in dense_linear_shapes(model.cfg))
        linear_flops *= model.cfg.n_layers
        flops = prefill_flops(model.cfg, n)
        print(f"prefill {n}: {total_s * 1e3:.1f} ms, {flops / total_s / peak:.0%} of the peak; "
              f"the linears alone at {linear_flops / parts['linears'] / peak:.0%}")
        rest = total_s - sum(parts.values())
        for part, s in sorted([*parts.items(), ("rest", rest)], key=lambda kv: -kv[1]):
            print(f"  {part:13s} {s * 1e3:8.1f} ms {s / total_s:6.1%}")


if __name__ == "__main__":
    main()
