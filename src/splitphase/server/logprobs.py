"""Logprobs in the two OpenAI shapes: legacy completions (with echo) and chat.

Completions: parallel lists `tokens`, `token_logprobs`, `top_logprobs` (dicts that also hold
the chosen token, as vLLM returns them) and `text_offset` (into the answer's `text`, where
special tokens such as the bos do not appear); with echo the prompt comes first and
its first token has `None` (nothing predicts it). lm-evaluation-harness sums
`token_logprobs[ctxlen:-1]` and checks greediness against `max(top_logprobs[i].values())`.
"""

from __future__ import annotations

from collections.abc import Sequence

from splitphase.engine.sampler import SampledToken
from splitphase.model.tokenizer import Tokenizer
from splitphase.server.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
)

PromptLogprobs = Sequence[tuple[float, tuple[tuple[int, float], ...]]]


class TokenText:
    """Display text of single tokens, cached (special tokens shown, as vLLM shows them)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self._special = set(tokenizer.special_tokens.values())

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text

    def width(self, token_id: int) -> int:
        """Characters the token adds to answer text, where special tokens are left out.

        Approximate for a character split over tokens (each part shows as U+FFFD).
        """
        return 0 if token_id in self._special else len(self(token_id))

    def bytes_of(self, token_id: int) -> list[int]:
        """The token's raw bytes (may be part of a UTF-8 character)."""
        return list(self.tokenizer.token_bytes(token_id))


def _top_dict(text: TokenText, chosen: int, chosen_lp: float | None,
              top: Sequence[tuple[int, float]]) -> dict[str, float]:
    d = {text(t): lp for t, lp in top}
    if chosen_lp is not None:
        d.setdefault(text(chosen), chosen_lp)
    return d


def completion_logprobs(
    text: TokenText,
    token_ids: Sequence[int],
    sampled: Sequence[SampledToken],
    start_offset: int = 0,
    prompt_ids: Sequence[int] | None = None,
    prompt_lps: PromptLogprobs | None = None,
) -> CompletionLogprobs:
    """The completions logprobs object for (echoed prompt +) generated tokens."""
    out = CompletionLogprobs()
    offset = start_offset
    if prompt_ids is not None:
        lps = list(prompt_lps or [])
        for i, tid in enumerate(prompt_ids):
            # Position 0 has no prediction; position i is predicted from [0, i).
            lp, top = (None, ()) if i == 0 else lps[i - 1]
            out.tokens.append(text(tid))
            out.token_logprobs.append(lp)
            out.top_logprobs.append(None if i == 0 else _top_dict(text, tid, lp, top))
            out.text_offset.append(offset)
            offset += text.width(tid)
    for tid, s in zip(token_ids, sampled, strict=False):
        out.tokens.append(text(tid))
        out.token_logprobs.append(s.logprob)
        out.top_logprobs.append(_top_dict(text, tid, s.logprob, s.top_logprobs))
        out.text_offset.append(offset)
        offset += text.width(tid)
    return out


def chat_logprobs(text: TokenText, token_ids: Sequence[int], sampled: Sequence[SampledToken],
                  top_n: int) -> ChatLogprobs:
    """The chat logprobs object: one entry per generated token, with `top_n` alternatives."""
    content = []
    for tid, s in zip(token_ids, sampled, strict=False):
        tops = [TopLogprob(token=text(t), logprob=lp, bytes=text.bytes_of(t))
                for t, lp in s.top_logprobs[:top_n]]
        content.append(ChatTokenLogprob(token=text(tid), logprob=s.logprob or 0.0,
                                        bytes=text.bytes_of(tid), top_logprobs=tops))
    return ChatLogprobs(content=content)


def prompt_logprobs_complete(prompt_ids: Sequence[int], prompt_lps: PromptLogprobs | None) -> bool:
    """True when the engine scored every prompt position after the first."""
    return prompt_lps is not None and len(prompt_lps) >= len(prompt_ids) - 1
