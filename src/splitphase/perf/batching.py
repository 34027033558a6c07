"""Continuous batching on our engine: output tok/s at N concurrent requests against one.

Every request has the same prompt length and output length; all N are submitted at once, so
after their prefills the engine decodes N sequences per step. The ratio to one request shows
how much of the batch-1 step was weight traffic that the batch now shares. The engine's step
records split each run into its phases: the decode steps' own speedup, and the share of the
concurrent run its prefill took (prefill is FLOP-bound at one request already, so N prompts
cost N times one: that share is what holds the end-to-end ratio below the decode steps').

The engine keeps its defaults (the chunked policy, a 2048-token budget) but for what a timed
run needs: an untimed round of the same size first, with other prompts, pays what only a
first call pays (packing the weights for prefill-shaped GEMMs: 0.3-0.4 s of base-125m's
32-request run), as a server does once at start-up; and prefix caching is off, so no round's
blocks serve another's prompts (a one-request run that repeated its warm-up's prompt found
48 of its 64 tokens cached).
"""

from __future__ import annotations

import time
from typing import Any

from splitphase.audit.flops import decode_flops, kv_bytes_per_token, prefill_flops
from splitphase.engine.llm import LLM
from splitphase.engine.llm_engine import StepRecord
from splitphase.engine.sampling_params import SamplingParams
from splitphase.model.config import ModelConfig
from splitphase.model.tokenizer import Tokenizer
from splitphase.model.transformer import Transformer


def _prompts(vocab: int, concurrent: int, prompt_len: int, round_: int) -> list[list[int]]:
    """`concurrent` prompts of `prompt_len` tokens; `round_` shifts every token."""
    return [[(r * 31 + i * 7 + round_ * 13) % (vocab - 5) + 5 for i in range(prompt_len)]
            for r in range(concurrent)]


def phase_rates(steps: list[StepRecord]) -> dict[str, float]:
    """Prompt tokens/s over the steps that prefill and output tokens/s over the steps that
    only decode: the run's two phases apart, from the engine's own step records."""
    prefill = [s for s in steps if s.num_prefill_tokens > 0]
    decode = [s for s in steps if s.num_prefill_tokens == 0 and s.num_decode_seqs > 0]
    out: dict[str, float] = {}
    if prefill:
        out["prefill_tok_per_s"] = (sum(s.num_prefill_tokens for s in prefill)
                                    / sum(s.wall_s for s in prefill))
    if decode:
        out["decode_tok_per_s"] = (sum(s.num_decode_seqs for s in decode)
                                   / sum(s.wall_s for s in decode))
    return out


def engine_rates(
    model: Transformer, concurrent: int, prompt_len: int, output_len: int
) -> dict[str, float]:
    """Output tokens/s of the engine serving `concurrent` identical-size requests at once,
    and the rates of its prefill and decode steps in that run (`phase_rates`)."""
    vocab = model.cfg.vocab_size
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
        kv_cache_bytes=kv_bytes,
        enable_prefix_caching=False,
    )
    params = [SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)] * concurrent
    llm.generate(_prompts(vocab, concurrent, prompt_len, round_=1), params)  # warm-up
    llm.engine.steps.clear()
    t0 = time.perf_counter()
    outs = llm.generate(_prompts(vocab, concurrent, prompt_len, round_=0), params)
    wall = time.perf_counter() - t0
    return {"tok_per_s": sum(len(o.token_ids) for o in outs) / wall,
            **phase_rates(llm.engine.steps)}


def request_flops(cfg: ModelConfig, prompt_len: int, output_len: int) -> float:
    """One request's FLOPs in the audit's model: its prefill (which makes the first output
    token), then a decode step for each further token, at its growing context."""
    steps = range(1, output_len)
    return prefill_flops(cfg, prompt_len) + sum(decode_flops(cfg, [prompt_len + t]) for t in steps)


def flop_bound_tok_per_s(
    cfg: ModelConfig, concurrent: int, prompt_len: int, output_len: int, peak_flops_per_s: float
) -> float:
    """The output tok/s `concurrent` such requests could reach if every FLOP ran at the peak:
    the ceiling the CPU's (or GPU's) FLOP rate puts on the batching speedup."""
    seconds = concurrent * request_flops(cfg, prompt_len, output_len) / peak_flops_per_s
    return concurrent * output_len / seconds


def measure(model: Transformer, concurrent: int, prompt_len: int, output_len: int
            ) -> dict[str, Any]:
    """One request's output tok/s and `concurrent` requests', on the same model, with the
    rates of each run's prefill and decode steps."""
    one = engine_rates(model, 1, prompt_len, output_len)
    many = engine_rates(model, concurrent, prompt_len, output_len)
    return {
        "dtype": str(model.embed_tokens.weight.dtype).removeprefix("torch."),
        "prompt_len": prompt_len, "output_len": output_len,
        **{f"engine_{k}_1": v for k, v in one.items()},
        **{f"engine_{k}_concurrent": v for k, v in many.items()},
    }


def figures(b: dict[str, Any], peaks: dict[str, float], cfg: ModelConfig, concurrent: int
            ) -> dict[str, Any]:
    """`measure`'s rates with the speedup, and the ceiling the run's matmul peak puts on it
    (where the peak was measured in the engine's dtype)."""
    out = {**b, "continuous_batching_speedup":
           b["engine_tok_per_s_concurrent"] / b["engine_tok_per_s_1"]}
    peak = peaks.get(f"matmul_model_shapes_flops_per_s_{b['dtype']}")
    if peak:
        bound = flop_bound_tok_per_s(cfg, concurrent, b["prompt_len"], b["output_len"], peak)
        out["flop_bound_tok_per_s_concurrent"] = bound
        out["flop_bound_speedup"] = bound / b["engine_tok_per_s_1"]
        out["concurrent_peak_fraction"] = b["engine_tok_per_s_concurrent"] / bound
    return {**out, **_phase_split(b, concurrent)}


def _phase_split(b: dict[str, Any], concurrent: int) -> dict[str, float]:
    """The decode steps' speedup alone, and the share of the concurrent run its prefill step(s)
    took: prefill is FLOP-bound at one request already, so batching cannot share it."""
    keys = ("engine_decode_tok_per_s_1", "engine_decode_tok_per_s_concurrent",
            "engine_prefill_tok_per_s_concurrent")
    if not all(k in b for k in keys):
        return {}
    prefill_s = concurrent * b["prompt_len"] / b["engine_prefill_tok_per_s_concurrent"]
    # Each request's first token comes out of its prefill step; the decode steps make the rest.
    decode_s = concurrent * (b["output_len"] - 1) / b["engine_decode_tok_per_s_concurrent"]
    return {
        "decode_batching_speedup":
            b["engine_decode_tok_per_s_concurrent"] / b["engine_decode_tok_per_s_1"],
        "prefill_time_fraction_concurrent": prefill_s / (prefill_s + decode_s),
    }
