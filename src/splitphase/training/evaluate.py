"""Validation metrics: token-level NLL over the held-out split, and continuation loss.

Continuation loss scores what decode produces: for a prompt that ends at a natural boundary b
(end of a verse or speech line, see splitphase.data), the NLL of the next `horizon` tokens
given up to `context` tokens of prompt. Boundaries are taken at a fixed stride so the metric
is deterministic and comparable between models.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

HORIZON = 32  # continuation tokens scored after each prompt
MAX_PROMPTS = 512  # continuation prompts, taken at a fixed stride


@dataclass(frozen=True)
class EvalResult:
    """Mean NLL in nats per token; `tokens` is how many predictions were scored."""

    loss: float
    tokens: int
    continuation_loss: float | None = None
    continuation_tokens: int = 0


def _batched_nll(model: nn.Module, windows: np.ndarray, batch_size: int) -> torch.Tensor:
    """Per-position NLL (N, T-1) for token windows (N, T)."""
    device = next(model.parameters()).device
    out = []
    for i in range(0, len(windows), batch_size):
        x = torch.from_numpy(windows[i : i + batch_size].astype(np.int64)).to(device)
        logits = model(x[:, :-1]).float()  # (B, T-1, V)
        nll = F.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none")  # (B, T-1)
        out.append(nll.cpu())
    return torch.cat(out) if out else torch.empty(0, windows.shape[1] - 1)


@torch.no_grad()
def validation_loss(
    model: nn.Module,
    tokens: np.ndarray,
    seq_len: int,
    batch_size: int = 16,
    max_tokens: int | None = None,
) -> tuple[float, int]:
    """Mean next-token NLL over non-overlapping windows of the split (teacher forced)."""
    usable = len(tokens) - 1 if max_tokens is None else min(len(tokens) - 1, max_tokens)
    n = usable // seq_len
    if n == 0:
        raise ValueError(f"split has {len(tokens)} tokens, fewer than one window of {seq_len + 1}")
    windows = np.stack([tokens[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])
    nll = _batched_nll(model, windows, batch_size)
    return float(nll.mean()), int(nll.numel())


@torch.no_grad()
def continuation_loss(
    model: nn.Module,
    tokens: np.ndarray,
    boundaries: np.ndarray,
    context: int = 192,
    horizon: int = HORIZON,
    max_prompts: int = MAX_PROMPTS,
    batch_size: int = 16,
) -> tuple[float, int]:
    """Mean NLL of the `horizon` tokens after each sampled prompt boundary."""
    valid = boundaries[(boundaries >= context) & (boundaries + horizon <= len(tokens))]
    if len(valid) == 0:
        raise ValueError("no prompt boundary leaves room for the context and horizon")
    stride = max(1, len(valid) // max_prompts)
    chosen = valid[::stride][:max_prompts]
    windows = np.stack([tokens[b - context : b + horizon] for b in chosen])  # (N, C+H)
    nll = _batched_nll(model, windows, batch_size)[:, context - 1 :]  # predictions of b..b+H-1
    return float(nll.mean()), int(nll.numel())


def evaluate(
    model: nn.Module,
    tokens: np.ndarray,
    boundaries: np.ndarray | None,
    seq_len: int,
    max_tokens: int | None = None,
    batch_size: int = 16,
    max_prompts: int = MAX_PROMPTS,
) -> EvalResult:
    """Validation loss and (when boundaries are given) continuation loss over `max_prompts`."""
    was_training = model.training
    model.eval()
    try:
        loss, n = validation_loss(model, tokens, seq_len, batch_size, max_tokens)
        if boundaries is None or len(boundaries) == 0:
            return EvalResult(loss, n)
        cont, m = continuation_loss(
            model, tokens, boundaries, max_prompts=max_prompts, batch_size=batch_size
        )
        return EvalResult(loss, n, cont, m)
    finally:
        model.train(was_training)
