"""What sampling costs a decode step, by SamplingParams, next to torch's own primitives.

A decode step ends in the sampler: one row of logits per request, over the whole vocabulary.
This times `splitphase.engine.sampler.sample` on random logits (seeded) for a batch of rows
and, the three pieces where the sampler replaces torch's primitives: the greedy rows' argmax
(numpy's, against `torch.argmax`), a categorical draw (`draw`, the inverse CDF at one uniform,
against `torch.multinomial`, which draws V exponentials) and the top-p sort (numpy's, against
`torch.sort`). Best of `--repeats`;
nothing is asserted.

    OMP_NUM_THREADS=2 python bench/sampler_cost.py --rows 1 16 32
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from splitphase.engine.sampler import SamplingState, sample
from splitphase.engine.sampling_params import SamplingParams
from splitphase.model.config import ModelConfig
from splitphase.model.transformer import draw
from splitphase.perf.timing import best_s

PARAMS = {
    "greedy": dict(temperature=0.0),
    "temperature 1": dict(temperature=1.0),
    "temp 0.8, top_p 0.9": dict(temperature=0.8, top_p=0.9),
    "temp 0.8, top_k 50": dict(temperature=0.8, top_k=50),
    "temperature 1, logprobs 5": dict(temperature=1.0, logprobs=5),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="base-125m", help="whose vocabulary size")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32])
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    vocab = ModelConfig.from_name(args.preset).vocab_size
    gen = torch.Generator().manual_seed(0)
    print(f"vocabulary {vocab}, {torch.get_num_threads()} threads; ms per step")
    print(f"{'params':28s} " + " ".join(f"{f'{r} rows':>9s}" for r in args.rows))
    for name, kw in PARAMS.items():
        cells = []
        for rows in args.rows:
            logits = torch.randn(rows, vocab, generator=gen) * 3
            states = [
                SamplingState.create(SamplingParams(max_tokens=8, **kw), i) for i in range(rows)
            ]
            cells.append(best_s(lambda: sample(logits, states), args.repeats))  # noqa: B023
        print(f"{name:28s} " + " ".join(f"{s * 1e3:9.2f}" for s in cells))
    probs = (torch.randn(vocab, generator=gen) * 3).softmax(-1)
    block = torch.randn(max(args.rows), vocab, generator=gen)
    pieces = [
        (f"greedy argmax of {block.shape[0]} rows", lambda: np.argmax(block.numpy(), axis=-1),
         lambda: block.argmax(-1)),
        ("draw (a row)", lambda: draw(probs, gen),
         lambda: torch.multinomial(probs, 1, generator=gen)),
        ("top-p sort (a row)", lambda: np.sort(probs.numpy()), lambda: probs.sort(descending=True)),
    ]
    for name, ours, theirs in pieces:
        a, b = best_s(ours, args.repeats * 5), best_s(theirs, args.repeats * 5)
        print(f"{name}: {a * 1e6:.0f} us, torch's {b * 1e6:.0f} us: {b / a:.1f}x")


if __name__ == "__main__":
    main()
