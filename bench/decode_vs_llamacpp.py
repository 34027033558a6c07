"""Batch-1 decode against llama.cpp, interleaved tightly: for a host whose memory speed moves.

`phase_limits` times each system in turn, minutes apart; on a VM whose memory bandwidth swings
between minutes (the AMD host: triad 44.7 GB/s in one run, 70.1 in the next) the ratio then
says as much about the minute as about the code. Here, in one process, short bursts alternate:
our decode step, the same step's linears alone (the skinny kernel over the same weights in the
same calls, nothing else), and llama.cpp's step on our GGUF export of the same model, all at
`--context` cached tokens. Best of each; the ratios are measured side by side. The linears-alone
figure says how much of our step is the weight stream itself. Nothing is asserted.

    OMP_NUM_THREADS=2 python bench/decode_vs_llamacpp.py --dtype float32 --rounds 12
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from splitphase.kernels import build, skinny
from splitphase.model.config import ModelConfig
from splitphase.model.transformer import Transformer
from splitphase.perf.llamacpp_baseline import (
    llama_cpp_module,
    llamacpp_decode_step,
    llamacpp_prompt,
    open_llamacpp,
)
from splitphase.perf.timing import decode_step_fn, interleaved_best_s


def _linears_alone(model: Transformer) -> Callable[[], None]:
    """The decode step's linears on one row, grouped as the native pass calls them."""
    w = model._decode_weights()  # per layer: norm, q, k, v, o, norm, gate, up, down
    head = model.lm_head.weight if model.lm_head is not None else model.embed_tokens.weight
    x = torch.randn(1, model.cfg.d_model, dtype=model.dtype)
    x_ff = torch.randn(1, model.cfg.d_ff, dtype=model.dtype)

    def run() -> None:
        for layer in range(model.cfg.n_layers):
            q, k, v, o, _, gate, up, down = w[9 * layer + 1 : 9 * layer + 9]
            skinny.linears(x, q, k, v)
            skinny.linear(x, o)
            skinny.linears(x, gate, up)
            skinny.linear(x_ff, down)
        skinny.linear(x, head)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="base-125m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--burst", type=int, default=4, help="steps of one system in a row")
    args = ap.parse_args()
    llama_cpp, why = llama_cpp_module()
    if llama_cpp is None:
        raise SystemExit(why)
    build.status()
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name(args.preset).with_(dtype=args.dtype)).eval()
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:  # llama.cpp maps the file; unlinking keeps it
        llm = open_llamacpp(llama_cpp, model, Path(tmp), threads, args.context + 8, args.context)
    prompt = llamacpp_prompt(model.cfg.vocab_size, args.context)
    llm.eval(prompt)
    systems = {
        "ours": decode_step_fn(model, 1, args.context),
        "linears alone": _linears_alone(model),
        "llama.cpp": llamacpp_decode_step(llm, prompt),
    }
    with torch.inference_mode():
        best = interleaved_best_s(systems, args.rounds, args.burst)
    print(f"{args.preset} {args.dtype}, context {args.context}, {threads} threads: "
          + ", ".join(f"{name} {s * 1e3:.2f} ms" for name, s in best.items()))
    print(f"ours {best['llama.cpp'] / best['ours']:.3f}x llama.cpp's speed; the step takes "
          f"{best['ours'] / best['linears alone']:.3f}x its linears alone")


if __name__ == "__main__":
    main()
