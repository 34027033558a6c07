"""Continuous batching on our engine: output tok/s at N concurrent requests against one.

Every request has the same prompt length and output length; all N are submitted at once, so
after their prefills the engine decodes N sequences per step. The ratio to one request shows
how much of the batch-1 step was weight traffic that the batch now shares.
"""

from __future__ import annotations

import time

from splitphase.audit.flops import kv_bytes_per_token
from splitphase.engine.llm import LLM
from splitphase.engine.sampling_params import SamplingParams
from splitphase.model.tokenizer import Tokenizer
from splitphase.model.transformer import Transformer


def engine_output_tok_per_s(
    model: Transformer, concurrent: int, prompt_len: int, output_len: int
) -> float:
    """Output tokens/s of the engine serving `concurrent` identical-size requests at once."""
    vocab = model.cfg.vocab_size
    prompts = [[(r * 31 + i * 7) % (vocab - 5) + 5 for i in range(prompt_len)]
               for r in range(concurrent)]
    dtype_bytes = model.embed_tokens.weight.element_size()
    # Room for every request plus a block of slack each; sized, not a fraction of free memory.
    kv_bytes = 2 * concurrent * (prompt_len + output_len + 64) * kv_bytes_per_token(
        model.cfg, dtype_bytes
    )
    llm = LLM(
        model,
        Tokenizer.default(),
        policy="chunked",
        max_num_seqs=max(concurrent, 1),
        max_num_batched_tokens=max(512, prompt_len),
        kv_cache_bytes=kv_bytes,
    )
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    llm.generate(prompts[:1], [params])  # warm-up: first-call allocations, kernel load
    t0 = time.perf_counter()
    outs = llm.generate(prompts, [params] * concurrent)
    wall = time.perf_counter() - t0
    return sum(len(o.token_ids) for o in outs) / wall
