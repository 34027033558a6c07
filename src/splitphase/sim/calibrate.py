"""Fit the cost model's efficiency factors to measured engine steps (weighted least squares).

Each sample is one step as scheduled (prefill chunks and decode context lengths) with its
measured wall time. The FLOP/byte parts of every step are computed once; a grid over the FLOP
fraction, the weights' and the KV cache's bandwidth fractions and the GEMM half-efficiency
size is then searched, with the three host overheads (per step, per sequence, per step that
carries prompt tokens) solved by non-negative least squares at each grid point.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from splitphase.audit.flops import attention_cost, step_cost
from splitphase.errors import UserError
from splitphase.hardware.specs import HardwareSpec
from splitphase.model.config import ModelConfig
from splitphase.sim.cost_model import CostModel, Efficiency

_FRACTIONS = np.geomspace(1e-3, 1.5, 40)
_HALF_TOKENS = (0.0, 16.0, 64.0, 256.0)


@dataclass(frozen=True)
class StepSample:
    """One measured step: what ran and how long it took."""

    chunks: tuple[tuple[int, int], ...]  # (new tokens, tokens computed before)
    decode_context_lens: tuple[int, ...]
    wall_s: float


def _parts(model: ModelConfig, samples: Sequence[StepSample], dtype_bytes: int) -> np.ndarray:
    rows = []
    for s in samples:
        cost = step_cost(model, s.chunks, s.decode_context_lens, dtype_bytes)
        attn = attention_cost(model, s.chunks, s.decode_context_lens, dtype_bytes)
        rows.append((cost.flops - attn.flops, cost.bytes - attn.bytes, attn.flops, attn.bytes,
                     cost.num_prefill_tokens + cost.num_decode_tokens,
                     len(s.chunks) + len(s.decode_context_lens), s.wall_s))
    return np.array(rows, dtype=float)


def fit_efficiency(model: ModelConfig, hardware: HardwareSpec, samples: Sequence[StepSample],
                   dtype: str = "float32", dtype_bytes: int = 4, source: str = "fit") -> Efficiency:
    """The Efficiency under which the cost model best predicts the samples' wall times."""
    samples = [s for s in samples if s.wall_s > 0 and (s.chunks or s.decode_context_lens)]
    if len(samples) < 4:
        raise UserError(f"calibration needs >= 4 measured steps, got {len(samples)}")
    p = _parts(model, samples, dtype_bytes)
    dense_f, dense_b, attn_f, attn_b, tokens, seqs, wall = p.T
    peak, bw = hardware.peak_flops_per_s(dtype), hardware.mem_bandwidth_bytes_per_s
    weight = _weights(samples, wall)
    has_prefill = np.array([1.0 if s.chunks else 0.0 for s in samples])
    design = np.stack([np.ones_like(wall), seqs, has_prefill], axis=1) * weight[:, None]
    fr = _FRACTIONS[:, None]
    dense_mem = dense_b[None, :] / (bw * fr)  # (F, N) over the weights' bandwidth fraction
    kv_mem = attn_b[None, :] / (bw * fr)  # (F, N) over the KV bandwidth fraction
    best: tuple[float, Efficiency] | None = None
    for half in _HALF_TOKENS:
        gemm = tokens / (tokens + half)
        for f in _FRACTIONS:
            dense = np.maximum(dense_f / (peak * f * gemm), dense_mem)  # (B, N)
            attn = np.maximum(attn_f / (peak * f), kv_mem)  # (K, N)
            roof = dense[:, None, :] + attn[None, :, :]  # (B, K, N)
            y = (wall - roof).reshape(-1, len(wall)) * weight
            coef, err = _nnls_batch(design, y)
            i = int(np.argmin(err))
            if best is None or err[i] < best[0]:
                b, k = divmod(i, len(_FRACTIONS))
                best = (float(err[i]), Efficiency(
                    float(f), float(_FRACTIONS[b]), float(coef[i, 0]), float(coef[i, 1]),
                    half, float(_FRACTIONS[k]), source,
                    prefill_step_overhead_s=float(coef[i, 2])))
    assert best is not None
    return best[1]


def _weights(samples: Sequence[StepSample], wall: np.ndarray) -> np.ndarray:
    """Steps that carry prompt tokens and decode-only steps weigh the same in total (TTFT rests
    on the first kind, TPOT mostly on the second); absolute error within each kind, scaled by
    its mean step, so the fit follows mean step times (latencies add steps up, and a busy
    machine's slow outliers belong in the mean)."""
    has_prefill = np.array([bool(s.chunks) for s in samples])
    out = np.zeros_like(wall)
    for mask in (has_prefill, ~has_prefill):
        if mask.any():
            out[mask] = 1.0 / (np.sqrt(mask.sum()) * wall[mask].mean())
    return out


def _nnls_batch(a: np.ndarray, ys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of `ys` (G, N): the non-negative coefficients of `a` (N, K) with least squared
    error, and that error. The optimum is the unconstrained fit on its own support, so the best
    all-non-negative fit over every subset of columns (and all-zero) is it; K is small."""
    g, k = ys.shape[0], a.shape[1]
    best_c, best_e = np.zeros((g, k)), np.sum(ys**2, axis=1)
    for support in itertools.product((False, True), repeat=k):
        cols = [j for j in range(k) if support[j]]
        if not cols:
            continue
        sub = a[:, cols]
        c = np.zeros((g, k))
        c[:, cols] = ys @ sub @ np.linalg.pinv(sub.T @ sub)
        err = np.where((c >= 0).all(axis=1), np.sum((c @ a.T - ys) ** 2, axis=1), np.inf)
        better = err < best_e
        best_c[better], best_e[better] = c[better], err[better]
    return best_c, best_e


def prediction_error(cost: CostModel, samples: Sequence[StepSample]) -> float:
    """Median relative error of the cost model's step times on the samples."""
    errs = sorted(
        abs(cost.step_time(s.chunks, s.decode_context_lens).total_s - s.wall_s) / s.wall_s
        for s in samples if s.wall_s > 0
    )
    return errs[len(errs) // 2] if errs else float("nan")
