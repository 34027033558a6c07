"""Decode step A/B in one process: the one-call native pass, the per-op native path, torch,
and the one-call pass with the skinny kernel up to its own MAX_ROWS (`kernel_max`: no early
hand-over to oneDNN's packed GEMM, `packed_linear.ONEDNN_MIN_ROWS`); where the kernel has AMX
tiles, bf16 without them (`no_amx_tiles`) or handed to oneDNN past 8 rows (`onednn_past_8`);
on an AVX2 build, every row count on the kernel's dot tile (`dot_tile`: its outer-product
tile off).

The variants alternate step by step (each on its own filled cache), so a busy spell on the
shared machine hits all of them alike; each figure is the best step and the median.
`--blocks` times consecutive steps per variant instead (as bench/phase_limits.py does), the
variants alternating block by block. Prints
ms per step, the bytes a step must move over the best time against the STREAM triad measured
in the same run, ratios to the first variant, and the load average. Nothing is asserted.

    OMP_NUM_THREADS=2 python bench/decode_ab.py --batch 1 8 --dtypes float32 bfloat16
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import NamedTuple

import torch

from splitphase.audit.flops import decode_bytes
from splitphase.kernels import decode_stack, packed_linear, skinny
from splitphase.model.config import ModelConfig
from splitphase.model.transformer import Transformer
from splitphase.perf.peaks import triad_bytes_per_s
from splitphase.perf.timing import filled_cache, time_decode


class Variant(NamedTuple):
    native: bool  # the native kernels
    fused: bool  # the one-call decode pass
    onednn_min_rows: int  # rows from which oneDNN's packed GEMM takes over (fp32, bf16)
    amx_min_rows: int = skinny.AMX_MIN_ROWS  # bf16 rows from which the kernel uses AMX tiles
    amx_bf16_min_rows: int = packed_linear.AMX_BF16_MIN_ROWS  # oneDNN's bf16 rows with AMX
    outer_min_rows: int = skinny.OUTER_MIN_ROWS  # rows from which the AVX2 outer tile serves


ONEDNN = packed_linear.ONEDNN_MIN_ROWS
VARIANTS = {
    "fused": Variant(True, True, ONEDNN),
    "per_op": Variant(True, False, ONEDNN),
    "torch": Variant(False, False, ONEDNN),
    "kernel_max": Variant(True, True, max(skinny.MAX_ROWS.values()) + 1),
    # Where the kernel has AMX tiles: bf16 on VDPBF16PS alone, or handed to oneDNN past 8 rows.
    "no_amx_tiles": Variant(True, True, ONEDNN, amx_min_rows=0),
    "onednn_past_8": Variant(True, True, ONEDNN, amx_bf16_min_rows=9),
    # An AVX2 build: every row count on the 4 x 1 dot tile, none on the outer-product tile.
    "dot_tile": Variant(True, True, ONEDNN, outer_min_rows=0),
}


def _set(variant: str) -> None:
    v = VARIANTS[variant]
    skinny.set_enabled(v.native)
    decode_stack.set_enabled(v.fused)
    # Module attributes read at each call: process-wide knobs.
    packed_linear.ONEDNN_MIN_ROWS = v.onednn_min_rows
    packed_linear.AMX_BF16_MIN_ROWS = v.amx_bf16_min_rows
    if skinny.amx_kernel():
        torch.ops.splitphase.set_amx_min_rows(v.amx_min_rows)
    if skinny.outer_tile():
        torch.ops.splitphase.set_outer_min_rows(v.outer_min_rows)


def _triad() -> float:
    return triad_bytes_per_s(torch.device("cpu"), 256, 8)  # as phase_limits measures it


def _alternate(
    model: Transformer, batch: int, context: int, steps: int, variants: list[str]
) -> dict[str, list[float]]:
    """Seconds of `steps` decode steps per variant, variants interleaved step by step."""
    caches = {v: filled_cache(model, batch, context, 2) for v in variants}
    ids = torch.randint(0, model.cfg.vocab_size, (batch,))
    times: dict[str, list[float]] = {v: [] for v in variants}
    for i in range(steps + 2):  # two untimed warm-up steps each
        for v in variants:
            _set(v)
            t0 = time.perf_counter()
            model.decode_step(ids, caches[v])
            if i >= 2:
                times[v].append(time.perf_counter() - t0)
            caches[v].length -= 1  # stay at `context`: every step costs the same
    _set(variants[0])
    return times


def _blocks(
    model: Transformer, batch: int, context: int, steps: int, variants: list[str]
) -> dict[str, list[float]]:
    """Best step of `steps` consecutive ones per variant (as phase_limits times decode), the
    variants alternating block by block for five rounds."""
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(5):
        for v in variants:
            _set(v)
            times[v].append(time_decode(model, batch, context, steps).step_s)
    _set(variants[0])
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="base-125m")
    ap.add_argument("--dtypes", nargs="+", default=["float32"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--variants", nargs="+", default=["fused", "per_op"], choices=list(VARIANTS))
    ap.add_argument("--blocks", action="store_true",
                    help="consecutive steps per variant (weights warm in L3 from the step before)")
    args = ap.parse_args()
    print(f"threads {torch.get_num_threads()}, load before {os.getloadavg()}")
    triad = _triad()
    for name in args.dtypes:
        torch.manual_seed(0)
        model = Transformer(ModelConfig.from_name(args.preset).with_(dtype=name)).eval()
        dtype_bytes = torch.empty(0, dtype=model.dtype).element_size()
        for batch in args.batch:
            run = _blocks if args.blocks else _alternate
            times = run(model, batch, args.context, args.steps, args.variants)
            moved = decode_bytes(model.cfg, [args.context] * batch, dtype_bytes)
            triad = max(triad, _triad())
            ref = min(times[args.variants[0]])
            print(f"{name} b{batch}: " + ", ".join(
                f"{v} best {1e3 * min(t):.2f} ms ({100 * moved / min(t) / triad:.0f}% triad, "
                f"{min(t) / ref:.3f}x) median {1e3 * statistics.median(t):.2f} ms"
                for v, t in times.items()))
    print(f"triad {triad / 1e9:.1f} GB/s (best of the run); load after {os.getloadavg()}")


if __name__ == "__main__":
    main()
