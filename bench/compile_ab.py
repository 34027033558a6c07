"""torch.compile A/B in one process: the model as it runs against its compiled passes.

Variants: "eager" is the model as it runs (native kernels, the one-call decode stack).
"native" runs the passes through the compiled pieces (`splitphase.model.compiled`) with the
native kernels traced as opaque ops, in decode too (the shipped flag leaves decode to the
one-call stack where it applies: this comparison decided it). "torch" compiles the pieces with
the native kernels switched off inside them, so inductor generates the norms, rotations and
SiLU around torch's GEMMs (attention stays native between the pieces in both). "per_op" is
eager with the one-call decode stack off (each layer's ops from Python: what the pieces
replace in decode). "unpacked" is eager with torch's linear instead of the packed prefill
GEMMs (which compiled pieces cannot call: kernels/packed_linear.py). "reference" is the eager
torch path, every native kernel off: what "torch" compiles.

Workloads: a prefill of `--prefill` tokens, decode steps at batch 1 and 8 over `--context`
cached tokens. Compile time is the first call of each (variant, workload) minus its best
call, wall clock (inductor compiles in worker processes, which a process clock would not
see); inductor caches compiled code on disk, so point TORCHINDUCTOR_CACHE_DIR at an empty
directory to time a cold compile. Runs alternate; each figure is the best of its rounds.
Outputs are checked against eager (max abs difference of the logits). Nothing is asserted.

    OMP_NUM_THREADS=1 python bench/compile_ab.py --clock process

On a loaded machine use `--clock process` (CPU seconds, which preemption does not inflate).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from splitphase.kernels import build, decode_stack, packed_linear, skinny
from splitphase.model import compiled
from splitphase.model.config import ModelConfig
from splitphase.model.transformer import Transformer
from splitphase.perf.timing import filled_cache


def _variant(name: str) -> contextlib.ExitStack:
    """The context a variant runs in."""
    stack = contextlib.ExitStack()
    stack.enter_context(compiled.switched(name in ("native", "torch")))
    stack.enter_context(compiled.native_in_graph(name != "torch"))  # both phases
    if name == "reference":
        stack.enter_context(skinny.switched(False))
    if name in ("native", "torch", "per_op"):  # the pieces' decode, not the one-call stack's
        stack.enter_context(decode_stack.switched(False))
    if name == "unpacked":
        stack.enter_context(packed_linear.switched(False))
    return stack


VARIANTS = ("eager", "native", "torch", "per_op", "unpacked", "reference")


def _workloads(model: Transformer, args: argparse.Namespace) -> dict[str, Callable[[], Any]]:
    """name -> a call returning logits; each leaves its cache as it found it."""
    vocab = model.cfg.vocab_size
    ids = torch.randint(0, vocab, (1, args.prefill))
    pcache = model.new_cache(1, args.prefill)

    def prefill() -> torch.Tensor:
        pcache.length = 0
        return model.prefill(ids, pcache)[0]

    out: dict[str, Callable[[], Any]] = {f"prefill_{args.prefill}": prefill}
    for batch in args.batches:
        cache = filled_cache(model, batch, args.context, 2)
        tok = torch.randint(0, vocab, (batch,))

        def step(cache: Any = cache, tok: torch.Tensor = tok) -> torch.Tensor:
            logits = model.decode_step(tok, cache)
            cache.length -= 1  # stay at `context`: every timed step costs the same
            return logits

        out[f"decode_b{batch}"] = step
    return out


def _first_calls(
    work: dict[str, Callable[[], Any]], variants: list[str]
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """Each (variant, workload)'s first call in wall seconds (compiles), and its max abs
    difference from eager's logits."""
    first: dict[str, dict[str, float]] = {v: {} for v in variants}
    diff: dict[str, dict[str, float]] = {v: {} for v in variants}
    for name, fn in work.items():
        with _variant("eager"):
            ref = fn()
        for v in variants:
            with _variant(v):
                t0 = time.perf_counter()
                got = fn()
                first[v][name] = time.perf_counter() - t0
            diff[v][name] = float((got.float() - ref.float()).abs().max())
    return first, diff


def _rounds(
    work: dict[str, Callable[[], Any]], variants: list[str], args: argparse.Namespace,
    clock: Callable[[], float],
) -> dict[str, dict[str, float]]:
    """Best seconds per (variant, workload), variants alternating call by call."""
    best = {v: {n: float("inf") for n in work} for v in variants}
    for _ in range(args.rounds):
        for name, fn in work.items():
            reps = args.decode_reps if name.startswith("decode") else 1
            for v in variants:
                with _variant(v):
                    for _ in range(reps):
                        t0 = clock()
                        fn()
                        best[v][name] = min(best[v][name], clock() - t0)
    return best


def _report(best: dict, first: dict, diff: dict, work: dict) -> None:
    base = best["eager"]
    for name in work:
        print(f"{name}: " + "; ".join(
            f"{v} {1e3 * b[name]:.2f} ms ({b[name] / base[name]:.3f}x eager, "
            f"compile {max(0.0, first[v][name] - b[name]):.1f} s, diff {diff[v][name]:.1e})"
            for v, b in best.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="base-125m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--decode-reps", type=int, default=5, help="decode steps per round")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--clock", choices=["wall", "process"], default="wall")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    variants = ["eager", *[v for v in args.variants if v != "eager"]]
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    print(f"threads {torch.get_num_threads()}, {args.clock} clock, load before {os.getloadavg()},"
          f" native kernels: {build.status().reason}")
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name(args.preset).with_(dtype=args.dtype)).eval()
    work = _workloads(model, args)
    first, diff = _first_calls(work, variants)
    best = _rounds(work, variants, args, clock)
    _report(best, first, diff, work)
    print(f"load after {os.getloadavg()}")
    if args.out:
        figures = {"args": vars(args), "best_s": best, "first_call_s": first, "max_abs_diff": diff}
        Path(args.out).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
