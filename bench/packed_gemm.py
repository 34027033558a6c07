"""Torch's linear against each packed GEMM (MKL's, oneDNN's) at the model's prefill shapes.

Which packed GEMM is fastest depends on the CPU (MKL takes its AVX2 path on AMD), so
`packed_linear` probes once per process; this prints the whole picture behind that choice:
GFLOP/s per weight shape and row count, best of `--repeats`, each packed weight timed right
after torch's linear on the same operands. Nothing is asserted.

    OMP_NUM_THREADS=2 python bench/packed_gemm.py --dtype float32 --rows 64 512 2048
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
import torch.nn.functional as F

from splitphase.kernels import gemm_choice, packed_gemms, packed_linear
from splitphase.model.config import ModelConfig
from splitphase.perf.peaks import model_matmul_shapes
from splitphase.perf.timing import best_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="base-125m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 512, 2048])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    cfg = ModelConfig.from_name(args.preset)
    names = [n for n in packed_linear.backends() if packed_gemms.takes(n, dtype)]
    print(f"{args.preset} {args.dtype}, {torch.get_num_threads()} threads, GFLOP/s; "
          f"the probe picks {packed_linear.backend_for(dtype)}")
    print(" rows  weight        torch  " + "  ".join(f"{n:>7s}" for n in names))
    g = torch.Generator().manual_seed(0)
    # The packed form always: the model's per-shape choice would hand some shapes to torch's
    # linear and the column would time nothing.
    with torch.no_grad(), packed_linear.switched(True), gemm_choice.forced("packed"):
        for rows in args.rows:
            for out_f, in_f in model_matmul_shapes(cfg):
                x = torch.randn(rows, in_f, generator=g).to(dtype)
                w = torch.randn(out_f, in_f, generator=g).to(dtype)
                flops = 2 * rows * in_f * out_f
                torch_s = best_s(partial(F.linear, x, w), args.repeats)
                rates: list[float | None] = [flops / torch_s / 1e9]
                for name in names:
                    with packed_linear.using_backend(name):
                        run = partial(packed_linear.linear, x, w, packed_linear.PackedWeight())
                        # None: under its rows (`min_rows`) this backend does not take the call
                        rates.append(None if run() is None
                                     else flops / best_s(run, args.repeats) / 1e9)
                print(f"{rows:5d}  {out_f:5d}x{in_f:<5d} "
                      + "  ".join("      -" if r is None else f"{r:7.1f}" for r in rates))


if __name__ == "__main__":
    main()
