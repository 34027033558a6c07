"""Fit the cost model's efficiency factors to measured engine steps (least relative error).

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
    weight = 1.0 / wall  # relative error: every step counts the same
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
                coef, *_ = np.linalg.lstsq(design, (wall - roof) * weight, rcond=None)
                coef = np.maximum(coef, 0.0)
                pred = roof + coef[0] + coef[1] * seqs
                err = float(np.sum(((pred - wall) * weight) ** 2))
                if best is None or err < best[0]:
                    best = (err, Efficiency(float(f), float(b), float(coef[0]), float(coef[1]),
                                            half, source))
    assert best is not None
    return best[1]


def prediction_error(cost: CostModel, samples: Sequence[StepSample]) -> float:
    """Median relative error of the cost model's step times on the samples."""
    errs = sorted(
        abs(cost.step_time(s.chunks, s.decode_context_lens).total_s - s.wall_s) / s.wall_s
        for s in samples if s.wall_s > 0
    )
    return errs[len(errs) // 2] if errs else float("nan")
