"""Turn last-position logits into tokens, one row per request, honouring its SamplingParams.

Each seeded request owns a torch.Generator, so its draws do not depend on what else is in the
batch (same seed + same prompt = same output). Logprobs are the model's own distribution
(log_softmax of the raw logits, before penalties, logit_bias and temperature), as vLLM reports.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from splitphase.engine.sampling_params import SamplingParams
from splitphase.model.transformer import draw


@dataclass
class SamplingState:
    """Per-sequence sampler state: its params, its generator and the tokens it produced."""

    params: SamplingParams
    generator: torch.Generator
    output_counts: Counter[int] = field(default_factory=Counter)
    # logit_bias as (ids, biases) tensors, built once rather than at every step
    bias: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def create(cls, params: SamplingParams, fallback_seed: int) -> SamplingState:
        gen = torch.Generator(device="cpu")
        gen.manual_seed(params.seed if params.seed is not None else fallback_seed)
        bias = None
        if params.logit_bias:
            bias = (torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long),
                    torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32))
        return cls(params, gen, bias=bias)


@dataclass(frozen=True)
class SampledToken:
    """A sampled token with its logprob and the top-N alternatives (when asked)."""

    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


def _apply_penalties(logits: torch.Tensor, state: SamplingState) -> torch.Tensor:
    p = state.params
    if not state.output_counts or (p.presence_penalty == 0 and p.frequency_penalty == 0):
        return logits
    ids = torch.tensor(list(state.output_counts), dtype=torch.long)
    counts = torch.tensor(list(state.output_counts.values()), dtype=logits.dtype)
    logits = logits.clone()
    # OpenAI's definition: mu[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty.
    logits[ids] -= counts * p.frequency_penalty + p.presence_penalty
    return logits


def _apply_logit_bias(logits: torch.Tensor, state: SamplingState) -> torch.Tensor:
    """OpenAI's logit_bias: each listed token's bias added to its logit before sampling."""
    if state.bias is None:
        return logits
    ids, bias = state.bias
    return logits.index_add(0, ids, bias.to(logits.dtype))


def _top_p_floor(probs: torch.Tensor, top_p: float) -> float:
    """The least probability top-p keeps: the likeliest tokens are kept while the mass before
    them is under top_p (the smallest set reaching it), ties with the last one kept too.

    Sorted by numpy: torch's CPU sort took 1.6-1.8 ms for one row of 32,000 on the 2-core
    machine (a 16-row decode step at top_p 0.9 spent 30 ms sampling, about its model time)
    where numpy's takes 66-69 us (`bench/sampler_cost.py`).
    """
    ascending = torch.from_numpy(np.sort(probs.numpy()))
    cum = ascending.cumsum(0)  # torch's: numpy's cumsum took as long as its sort
    # ascending[j] is dropped when the mass above it, cum[-1] - cum[j], reaches top_p: the
    # dropped are a prefix, up to the last j with cum[j] <= cum[-1] - top_p.
    last = int(torch.searchsorted(cum, cum[-1:] - top_p, right=True)) - 1
    if last < 0:
        return 0.0  # none: every token stays
    # The likeliest token always stays (as in vLLM): a top_p that rounds to 0 in fp32 (5e-324)
    # dropped every token, NaN probabilities, a failed step for all its rows.
    return float(ascending[min(last, ascending.numel() - 2) + 1])


def _filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks (vLLM's order)."""
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.numel():
        kth = logits.topk(p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < _top_p_floor(probs, p.top_p), float("-inf"))
    if p.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


def sample_row(logits: torch.Tensor, state: SamplingState) -> SampledToken:
    """Sample one token from logits (V,) for one sequence and record it in its state."""
    p = state.params
    raw = logits.float().cpu()
    adjusted = _apply_logit_bias(_apply_penalties(raw, state), state)
    if p.is_greedy:
        token = int(adjusted.argmax())
    else:
        probs = _filter(adjusted, p).softmax(-1)
        token = draw(probs, state.generator)
    state.output_counts[token] += 1
    if p.logprobs is None:
        return SampledToken(token)
    logp = raw.log_softmax(-1)
    top: tuple[tuple[int, float], ...] = ()
    if p.logprobs > 0:
        values, ids = logp.topk(p.logprobs)
        top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return SampledToken(token, float(logp[token]), top)


def plain_greedy(state: SamplingState) -> bool:
    """True when a row's token is the argmax of its raw logits: greedy, with no penalties,
    logit_bias or logprobs to apply."""
    p = state.params
    return (p.is_greedy and p.logprobs is None and state.bias is None
            and p.presence_penalty == 0 and p.frequency_penalty == 0)


def sample_plain_greedy(
    logits: torch.Tensor, states: dict[int, SamplingState]
) -> dict[int, SampledToken]:
    """The tokens of the rows of logits (N, V) whose state is `plain_greedy`, by row, in one
    argmax, recorded in their states (the other rows are left out): `sample_row` costs 45 us
    of copies and Python a row, 1.5 ms of a 32-row decode step. Ties go to the first index,
    as in `sample_row`."""
    rows = [i for i, state in states.items() if plain_greedy(state)]
    if not rows:
        return {}
    picked = logits if rows == list(range(logits.shape[0])) else logits[rows]
    tokens = _argmax_rows(picked)
    for i, token in zip(rows, tokens, strict=True):
        states[i].output_counts[token] += 1
    return {i: SampledToken(token) for i, token in zip(rows, tokens, strict=True)}


def _argmax_rows(x: torch.Tensor) -> list[int]:
    """Each row's first index of its largest value. numpy's for fp32 on the CPU: torch's
    argmax took 743 us for 32 rows of 32,000 on the 2-core machine, numpy's 146 us (both give
    the first index on ties and on NaN)."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        return [int(i) for i in np.argmax(x.numpy(), axis=-1)]
    return [int(i) for i in x.argmax(-1).tolist()]


def sample(logits: torch.Tensor, states: list[SamplingState]) -> list[SampledToken]:
    """One token per row of logits (N, V): the plain-greedy rows in one argmax, the others
    one by one."""
    fast = sample_plain_greedy(logits, dict(enumerate(states)))
    return [fast[i] if i in fast else sample_row(logits[i], s) for i, s in enumerate(states)]


def prompt_logprobs(
    logits: torch.Tensor, token_ids: list[int], top_n: int
) -> list[tuple[float, tuple[tuple[int, float], ...]]]:
    """Logprob of each next prompt token under logits (T, V) of the positions before it."""
    logp = logits.float().log_softmax(-1)  # (T, V)
    targets = torch.tensor(token_ids, dtype=torch.long)
    chosen = logp.gather(-1, targets[:, None])[:, 0].tolist()
    out = []
    for i, value in enumerate(chosen):
        top: tuple[tuple[int, float], ...] = ()
        if top_n > 0:
            v, ids = logp[i].topk(top_n)
            top = tuple(zip(ids.tolist(), v.tolist(), strict=True))
        out.append((float(value), top))
    return out
