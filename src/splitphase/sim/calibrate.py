"""Fit the cost model's efficiency factors to measured engine steps (weighted least squares).

Each sample is one step as scheduled (prefill chunks and decode context lengths) with its
measured wall time. The FLOP/byte parts of every step are computed once; a grid over the FLOP
fraction, the bandwidth fraction and the GEMM half-efficiency size is then searched, with the
two host overheads (per step, per sequence) solved by least squares at each grid point.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from splitphase.audit.flops import attention_cost, step_cost
from splitphase.errors import UserError
from splitphase.hardware.specs import HardwareSpec
from splitphase.model.config import ModelConfig
from splitphase.sim.cost_model import CostModel, Efficiency

_FRACTIONS = np.geomspace(1e-3, 1.5, 48)
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
    # Steps that carry prompt tokens and decode-only steps weigh the same in total: TTFT rests
    # on the first kind, TPOT mostly on the second.
    has_prefill = np.array([bool(s.chunks) for s in samples])
    n_pre = max(int(has_prefill.sum()), 1)
    n_dec = max(int((~has_prefill).sum()), 1)
    # Absolute error within each kind (scaled by its mean step), so the fit follows mean step
    # times: latencies add steps up, and a busy machine's slow outliers belong in the mean.
    pre_mean = float(wall[has_prefill].mean()) if has_prefill.any() else 1.0
    dec_mean = float(wall[~has_prefill].mean()) if (~has_prefill).any() else 1.0
    weight = np.where(has_prefill, 1.0 / (np.sqrt(n_pre) * pre_mean),
                      1.0 / (np.sqrt(n_dec) * dec_mean))
    design = np.stack([np.ones_like(wall), seqs], axis=1) * weight[:, None]
    best: tuple[float, Efficiency] | None = None
    for half in _HALF_TOKENS:
        gemm = tokens / (tokens + half)
        for f in _FRACTIONS:
            dense_c = dense_f / (peak * f * gemm)
            attn_c = attn_f / (peak * f)
            for b in _FRACTIONS:
                roof = (np.maximum(dense_c, dense_b / (bw * b))
                        + np.maximum(attn_c, attn_b / (bw * b)))
                coef = _nnls2(design, (wall - roof) * weight)
                pred = roof + coef[0] + coef[1] * seqs
                err = float(np.sum(((pred - wall) * weight) ** 2))
                if best is None or err < best[0]:
                    best = (err, Efficiency(float(f), float(b), float(coef[0]), float(coef[1]),
                                            half, source))
    assert best is not None
    return best[1]


def _nnls2(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with two non-negative coefficients (the best of the four active sets)."""
    best, best_err = np.zeros(2), float(np.sum(y**2))
    for cols in ((0, 1), (0,), (1,)):
        sub = a[:, cols]
        c, *_ = np.linalg.lstsq(sub, y, rcond=None)
        if np.all(c >= 0):
            err = float(np.sum((sub @ c - y) ** 2))
            if err < best_err:
                best, best_err = np.zeros(2), err
                best[list(cols)] = c
    return best


def prediction_error(cost: CostModel, samples: Sequence[StepSample]) -> float:
    """Median relative error of the cost model's step times on the samples."""
    errs = sorted(
        abs(cost.step_time(s.chunks, s.decode_context_lens).total_s - s.wall_s) / s.wall_s
        for s in samples if s.wall_s > 0
    )
    return errs[len(errs) // 2] if errs else float("nan")
