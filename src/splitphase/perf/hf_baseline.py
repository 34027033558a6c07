"""The same weights through Hugging Face transformers' Llama, timed as users would run it.

Decode is `generate` with its KV cache, greedy; a logits processor stamps the clock at every
generated token, so a decode step is the time between two stamps (the best one, as ours).
Prefill is the one-token `generate` (prompt forward plus one logits row), as our `prefill`.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from splitphase.model.transformer import Transformer
from splitphase.perf.timing import best_s


def hf_llama(model: Transformer) -> Any | None:
    """A `LlamaForCausalLM` holding `model`'s weights in its dtype and on its device, or None
    without transformers."""
    try:
        import transformers
    except ImportError:
        return None
    cfg = model.cfg
    hf_cfg = transformers.LlamaConfig(  # type: ignore[call-arg]
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_embeddings,
        max_position_embeddings=cfg.max_seq_len,
        pad_token_id=0,
    )
    hf: Any = transformers.LlamaForCausalLM(hf_cfg)
    hf = hf.to(device=model.device, dtype=model.dtype).eval()
    state = model.state_dict()
    body = {k: v for k, v in state.items() if k != "lm_head.weight"}
    hf.model.load_state_dict(body, strict=False)
    if not cfg.tie_embeddings:
        hf.lm_head.weight.data.copy_(state["lm_head.weight"])
    return hf


class _Stamps:
    """A logits processor that records when each generated token's logits arrive."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.is_cuda:  # the step's kernels may still run: stamp when its logits exist
            torch.cuda.synchronize(scores.device)
        self.times.append(time.perf_counter())
        return scores


def _generate(hf: Any, ids: torch.Tensor, new_tokens: int, stamps: _Stamps | None = None) -> None:
    from transformers import LogitsProcessorList

    with torch.inference_mode():
        hf.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            logits_processor=LogitsProcessorList([stamps] if stamps else []),
        )


def time_hf(
    hf: Any, vocab: int, context: int, decode_tokens: int, prefill_len: int, repeats: int
) -> dict[str, float]:
    """transformers' decode tok/s at batch 1 (after `context` tokens) and prefill seconds."""
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(5, vocab, (1, context), generator=g).to(hf.device)
    stamps = _Stamps()
    _generate(hf, prompt, 1 + decode_tokens, stamps)
    steps = [b - a for a, b in zip(stamps.times, stamps.times[1:], strict=False)]
    ids = torch.randint(5, vocab, (1, prefill_len), generator=g).to(hf.device)
    return {
        "decode_step_s_b1": min(steps),
        "prefill_s": best_s(lambda: _generate(hf, ids, 1), repeats),
    }
