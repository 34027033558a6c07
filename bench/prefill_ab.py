"""Prefill A/B in one process: the model as it runs against variants that change one thing.

"model" is the model as it runs (residual add + RMSNorm in one native pass, SiLU*mul in one,
fp32 linears on packed weights within their memory budget); "unpacked" takes torch's
linear instead (`SPLITPHASE_PACKED_PREFILL=0`); "packed-mkl" and "packed-onednn" force that
packed GEMM (`SPLITPHASE_PACKED_GEMM`); "unfused" swaps in the torch arithmetic the
element-wise passes replaced (`x + r` then the norm; `F.silu(g) * u`); "fresh" has those native
passes write new buffers instead of over the projection's output; "sdpa" runs attention through
torch's SDPA instead of the native causal prefill kernel; "no-amx-attention" keeps bf16
attention in the native kernel off the AMX tiles (VDPBF16PS); "form-packed", "form-split" and
"form-torch" run every packed linear in that form instead of the one `gemm_choice` timed fastest
for its shape and rows ("form-packed" is the model before that choice); everything else equal. Runs
alternate, each timed after one untimed prefill in its variant (a backend switch repacks the
weights there), each figure is the best run; the FLOP fraction uses
`splitphase.audit.flops.prefill_flops` (causal attention: n(n+1)/2
query-key pairs, the LM head at the last position) over the best linear rate at the model's
shapes (torch's or the packed GEMM's), measured in the same run. Nothing is asserted.

    OMP_NUM_THREADS=2 python bench/prefill_ab.py --lengths 512 2048

On a loaded machine wall times swing 2-3x between runs (a preempted thread stalls every
parallel region); `OMP_NUM_THREADS=1 ... --clock process` times the CPU seconds the process
used instead, which preemption does not inflate: an A/B of the work each variant does, not of
its parallel scaling.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from splitphase.audit.flops import prefill_flops
from splitphase.hardware.memory import keep_freed_memory
from splitphase.kernels import elementwise, gemm_choice, packed_linear, prefill_attention
from splitphase.model.config import ModelConfig
from splitphase.model.transformer import Transformer
from splitphase.perf.peaks import matmul_peak_flops_per_s


@contextlib.contextmanager
def _swapped(silu_mul: Callable[..., object], add_rms_norm: Callable[..., object]
             ) -> Iterator[None]:
    """The model's element-wise passes (`silu_mul_`, `add_rms_norm_`) replaced inside."""
    real = elementwise.silu_mul_, elementwise.add_rms_norm_
    elementwise.silu_mul_, elementwise.add_rms_norm_ = silu_mul, add_rms_norm  # type: ignore
    try:
        yield
    finally:
        elementwise.silu_mul_, elementwise.add_rms_norm_ = real


def _unfused() -> contextlib.AbstractContextManager[None]:
    """The arithmetic before the fusions: separate add and norm, SiLU then multiply."""
    return _swapped(lambda g, u: F.silu(g) * u, lambda *a: None)


def _fresh() -> contextlib.AbstractContextManager[None]:
    """The native passes writing fresh buffers, not over the projection's output."""
    return _swapped(elementwise.silu_mul, elementwise.add_rms_norm)


def _unpacked() -> contextlib.AbstractContextManager[None]:
    """Torch's linear (MKL repacks the weight every call) instead of the packed GEMM."""
    return packed_linear.switched(False)


def _sdpa() -> contextlib.AbstractContextManager[None]:
    """Torch's SDPA (its CPU flash kernel) instead of the native causal prefill attention."""
    return prefill_attention.switched(False)


def _no_amx_attention() -> contextlib.AbstractContextManager[None]:
    """bf16 attention in the native kernel on VDPBF16PS, not on AMX tiles (where it has them)."""
    return prefill_attention.amx_switched(False)


def _gemm(name: str) -> Callable[[], contextlib.AbstractContextManager[None]]:
    """The packed GEMM of backend `name` (MKL's, oneDNN's) whatever the probe picked."""
    return lambda: packed_linear.using_backend(name)


def _form(name: str) -> Callable[[], contextlib.AbstractContextManager[None]]:
    """Every packed linear in form `name` (packed, split, torch) instead of the timed choice."""
    return lambda: gemm_choice.forced(name)


VARIANTS: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "model": contextlib.nullcontext, "unpacked": _unpacked, "unfused": _unfused,
    "fresh": _fresh, "sdpa": _sdpa, "no-amx-attention": _no_amx_attention,
    **{f"packed-{name}": _gemm(name) for name in packed_linear.backends()},
    **{f"form-{name}": _form(name) for name in gemm_choice.FORMS}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="base-125m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--default-malloc", action="store_true",
                    help="leave glibc's thresholds (the engine fixes them: keep_freed_memory)")
    ap.add_argument("--clock", choices=["wall", "process"], default="wall")
    args = ap.parse_args()
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    kept = not args.default_malloc and keep_freed_memory()
    print(f"threads {torch.get_num_threads()}, {args.clock} clock, malloc keeps freed memory: "
          f"{kept}, load before {os.getloadavg()}")
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name(args.preset).with_(dtype=args.dtype)).eval()
    dtype = model.dtype
    peak = matmul_peak_flops_per_s(model.cfg, dtype)["best"]
    results: dict[int, dict[str, float]] = {}
    for n in args.lengths:
        ids = torch.randint(0, model.cfg.vocab_size, (1, n))
        cache = model.new_cache(1, n)
        best = {v: float("inf") for v in args.variants}
        for r in range(args.rounds + 1):  # round 0 warms up and is not kept
            for variant in best:
                with VARIANTS[variant]():
                    cache.length = 0
                    model.prefill(ids, cache)  # a backend switch repacks here, untimed
                    cache.length = 0
                    t0 = clock()
                    model.prefill(ids, cache)
                    if r:
                        best[variant] = min(best[variant], clock() - t0)
            peak = max(peak, matmul_peak_flops_per_s(model.cfg, dtype, repeats=3)["best"])
        results[n] = best
    for n, best in results.items():  # fractions of the run's best peak
        flops = prefill_flops(model.cfg, n)
        print(f"prefill {n}: " + ", ".join(
            f"{v} {1e3 * s:.1f} ms ({100 * flops / s / peak:.0f}% of matmul peak)"
            for v, s in best.items()) + _ratios(best))
    print(f"matmul peak {peak / 1e9:.0f} GFLOP/s (best of the run); load after {os.getloadavg()}")


def _ratios(best: dict[str, float]) -> str:
    """Each variant's time over the first one's (>1: the first is faster)."""
    first, t0 = next(iter(best.items()))
    return "".join(f"; {v}/{first} {s / t0:.3f}x" for v, s in list(best.items())[1:])


if __name__ == "__main__":
    main()
