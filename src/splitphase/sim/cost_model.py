"""Step time of a scheduled batch: roofline of its FLOPs and bytes, scaled by efficiency factors.

time = step_overhead_s + per_seq_overhead_s * seqs (+ prefill_step_overhead_s with prompt tokens)
       + roofline(dense part) + roofline(attention part) + all-reduce time,
roofline(part) = max(flops / (tp * peak * flops_fraction),
                     bytes / (tp * bandwidth * bandwidth_fraction)),
the dense part's FLOP rate scaled by n / (n + gemm_half_tokens) for its n tokens.
The dense part (projections, MLP, LM head: one GEMM over every token of the batch, weights read
once) and the attention part (QK^T and AV over each sequence's KV cache) run as separate
kernels, so their times add (as Vidur models operators one by one): a decode batch's KV reads
do not hide under a prefill chunk's GEMMs. That is the prefill-decode interference DistServe
measured. Tensor parallelism: two ring all-reduces of the hidden states per layer.
FLOPs and bytes come from `audit.flops.step_cost` (the same formulas the engine tags its steps
with); peaks from the hardware table or the measured CPU calibration. Pure Python, no torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import NamedTuple

from splitphase.audit.flops import kv_bytes_per_token, param_count
from splitphase.engine.policies import SchedulerOutput
from splitphase.errors import UserError
from splitphase.hardware.specs import HardwareSpec, LinkSpec
from splitphase.model.config import ModelConfig
from splitphase.sim.step_work import DenseStepWork, StepWork, step_work

# Typical values for a tuned engine on datacenter GPUs, used when nothing was measured:
# prefill reaches about half of the dense bf16 peak (MFU 40-60% in the Sarathi-Serve and
# DistServe evaluations); decode reads weights and KV at about 60% of HBM bandwidth (MBU
# 55-70%, Databricks "LLM Inference Performance Engineering", 2023); about 1 ms of host work
# per step (scheduling, input preparation, sampling). A GEMM over few rows does not reach that
# rate: we scale it by n / (n + n_half) for n tokens in the step, with n_half = 128 tokens
# (bf16 GEMMs with K, N ~ 4k on H100-class parts reach about half their large-M rate near
# M = 128; the reason Sarathi-Serve keeps prefill chunks at 512 tokens or more).
DEFAULT_GEMM_HALF_TOKENS = 128.0
DEFAULT_FLOPS_FRACTION = 0.5
DEFAULT_BANDWIDTH_FRACTION = 0.6
DEFAULT_STEP_OVERHEAD_S = 1e-3
DEFAULT_MEMORY_FRACTION = 0.9  # of device memory usable for weights + KV (vLLM's default)


class CostModelError(UserError):
    """A cost-model setting that cannot work (e.g. a TP degree the model cannot be split by)."""


@dataclass(frozen=True)
class Efficiency:
    """How far below the roofline an engine runs, and its fixed host costs per step."""

    flops_fraction: float = DEFAULT_FLOPS_FRACTION
    bandwidth_fraction: float = DEFAULT_BANDWIDTH_FRACTION
    step_overhead_s: float = DEFAULT_STEP_OVERHEAD_S
    per_seq_overhead_s: float = 0.0
    gemm_half_tokens: float = DEFAULT_GEMM_HALF_TOKENS  # 0: every GEMM at flops_fraction
    # KV-cache reads in attention (paged gathers) may stream slower than weights; None: same.
    kv_bandwidth_fraction: float | None = None
    source: str = "typical values (splitphase.sim.cost_model defaults)"
    # Extra host time of a step that carries prompt tokens: an engine may take a leaner path
    # for decode-only steps (ours runs them as one native call, prompts op by op).
    prefill_step_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("flops_fraction", "bandwidth_fraction", "kv_bandwidth_fraction"):
            v = getattr(self, name)
            if v is None:
                continue
            if not (math.isfinite(v) and 0 < v <= 1.5):
                raise CostModelError(f"{name} must be in (0, 1.5], got {v}")
        if min(self.step_overhead_s, self.per_seq_overhead_s, self.prefill_step_overhead_s) < 0:
            raise CostModelError("overheads must be >= 0 seconds")
        if self.gemm_half_tokens < 0:
            raise CostModelError("gemm_half_tokens must be >= 0")

    @classmethod
    def from_audit_report(cls, path: str | Path) -> Efficiency:
        """Measured prefill FLOP utilization and decode bandwidth utilization of an audit."""
        p = Path(path)
        p = p / "report.json" if p.is_dir() else p
        try:
            doc = json.loads(p.read_text())
            flops_u = float(doc["prefill"]["flops_utilization"])
            bw_u = float(doc["decode"]["bandwidth_utilization"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CostModelError(
                f"{p}: not an audit report.json with prefill.flops_utilization and"
                f" decode.bandwidth_utilization ({exc})"
            ) from exc
        if not (flops_u > 0 and bw_u > 0):
            raise CostModelError(f"{p}: utilizations must be > 0 to calibrate from")
        # The audit's prefill utilization is measured on whole prompts: the large-M rate.
        model = doc.get("model", {})
        width, weights = model.get("kv_dtype_bytes"), model.get("weight_format")
        measured = [f"{width}-byte K/V elements"] if width else []
        measured += [f"{weights} weights"] if weights else []
        said = f" (decode measured with {' and '.join(measured)})" if measured else ""
        return cls(min(flops_u, 1.5), min(bw_u, 1.5), source=f"audit report {p}{said}")

    def to_dict(self) -> dict[str, object]:
        return {
            "flops_fraction": self.flops_fraction,
            "bandwidth_fraction": self.bandwidth_fraction,
            "step_overhead_s": self.step_overhead_s,
            "per_seq_overhead_s": self.per_seq_overhead_s,
            "prefill_step_overhead_s": self.prefill_step_overhead_s,
            "gemm_half_tokens": self.gemm_half_tokens,
            "kv_bandwidth_fraction": self.kv_bandwidth_fraction,
            "source": self.source,
        }


class StepTime(NamedTuple):
    """One step's simulated time, and how much of its roofline time was prefill work."""

    total_s: float
    prefill_share: float  # 0..1: prefill's part of the step, used to split cost by phase


@dataclass(frozen=True)
class CostModel:
    """Step time of one replica (`tp` devices of `hardware` running `model`)."""

    model: ModelConfig
    hardware: HardwareSpec
    tp: int = 1
    efficiency: Efficiency = field(default_factory=Efficiency)
    dtype: str = "bfloat16"
    dtype_bytes: int = 2
    tp_link: LinkSpec | None = None  # default: the hardware's interconnect (NVLink)
    # The K/V cache's bytes per element (an fp8 cache: 1); None: dtype_bytes. Sets how many
    # tokens fit, the K/V bytes a step reads and what a disaggregated pair sends.
    kv_dtype_bytes: int | None = None
    # Bytes per weight when the weights are narrower than dtype_bytes (quantized: FP8 1, INT4
    # about 0.52); None: dtype_bytes. dtype is then the matmuls' (FP8's: float8).
    weight_bytes_per_param: float | None = None

    def __post_init__(self) -> None:
        cfg = self.model
        if self.tp < 1 or cfg.n_kv_heads % self.tp and self.tp % cfg.n_kv_heads:
            raise CostModelError(
                f"tensor parallelism {self.tp} does not split {cfg.n_kv_heads} KV heads"
            )
        if self.tp > 1 and self._link() is None:
            raise CostModelError(
                f"{self.hardware.name} has no interconnect in the hardware table: TP > 1 needs"
                " a link (set tp_link)"
            )
        self.hardware.peak_flops_per_s(self.dtype)  # fails early on an unsupported dtype

    def _link(self) -> LinkSpec | None:
        if self.tp_link is not None:
            return self.tp_link
        bw = self.hardware.interconnect_bytes_per_s
        # The table's figure is bidirectional per GPU; a ring step sends one way.
        return None if bw is None else LinkSpec("interconnect", bw / 2, 5e-6, "hardware table")

    @property
    def weight_bytes(self) -> float:
        """Bytes of weights per device (split evenly by tensor parallelism)."""
        return param_count(self.model) * self._weight_b / self.tp

    @property
    def _weight_b(self) -> float:
        w = self.weight_bytes_per_param
        return self.dtype_bytes if w is None else w

    @property
    def _kv_b(self) -> int:
        return self.dtype_bytes if self.kv_dtype_bytes is None else self.kv_dtype_bytes

    def kv_bytes_per_token(self) -> int:
        """KV bytes per token across the replica's devices."""
        return kv_bytes_per_token(self.model, self._kv_b)

    def num_kv_blocks(self, block_size: int, memory_fraction: float = DEFAULT_MEMORY_FRACTION
                      ) -> int:
        """KV blocks that fit beside the weights on the replica's devices."""
        free = self.tp * (self.hardware.mem_capacity_bytes * memory_fraction - self.weight_bytes)
        blocks = int(free // (self.kv_bytes_per_token() * block_size))
        if blocks < 1:
            raise CostModelError(
                f"{self.model.name} does not fit on {self.tp} x {self.hardware.name}: weights"
                f" take {self.weight_bytes / 1e9:.1f} GB per device; raise the TP degree"
            )
        return blocks

    def step_time(self, chunks: Sequence[tuple[int, int]], decode_context_lens: Sequence[int]
                  ) -> StepTime:
        """Time of a step with prefill chunks (new, before) and decodes (cached lengths)."""
        return self._time_of(step_work(self.model, chunks, decode_context_lens, self._weight_b,
                                       self._kv_b))

    def step_time_of(self, out: SchedulerOutput) -> StepTime:
        """Time of one scheduled step (equal to `step_time` of its chunks and decodes)."""
        if not out.prefill and self._dense is not None and out.decode:
            return self._decode_only_time(len(out.decode), out.decode.num_cached_tokens)
        chunks = [(c.num_tokens, c.start) for c in out.prefill]
        if self._dense is None:
            return self.step_time(chunks, out.decode.positions)
        return self._time_of(
            self._dense.work(chunks, len(out.decode), out.decode.num_cached_tokens)
        )

    def decode_steps_s(self, positions: Sequence[int], first: int, last: int) -> list[float]:
        """Times of decode-only steps k = first..last, whose rows sit at `positions` + k.

        Each equals `step_time_of` of that step's `SchedulerOutput` (the same arithmetic).
        """
        n = len(positions)
        if self._dense is not None:
            cached = sum(positions)
            return self._decode_only_totals(n, range(cached + first * n, cached + last * n + 1, n))
        return [self.step_time([], [p + k for p in positions]).total_s
                for k in range(first, last + 1)]

    def _decode_only_time(self, num_decodes: int, num_cached: int) -> StepTime:
        """`_time_of(work([], n, cached))` of a dense model, with no prefill part."""
        # No prefill work: its share is 0.0, as _time_of finds.
        return StepTime(self._decode_only_totals(num_decodes, (num_cached,))[0], 0.0)

    def _decode_only_totals(self, num_decodes: int, num_cached: Iterable[int]) -> list[float]:
        """`_time_of(work([], n, c)).total_s` of a dense model for each c, term for term.

        Most simulated steps decode only; this skips the prefill half's zero terms and the
        StepWork tuple, and hoists what does not depend on c. The float operations are the same
        ones in the same order, so each time is bit-identical (tests/sim/test_step_work.py).
        """
        d = self._dense
        assert d is not None
        eff, rows = self.efficiency, num_decodes
        flops_rate, bytes_rate, kv_rate = self._rates
        row_flops = d.row_flops * rows + d.logit_flops * rows  # integers: any order is exact
        weight_bytes = d.dtype_bytes * (d.params + rows * d.d_model)
        gemm_rate = flops_rate * rows / (rows + eff.gemm_half_tokens)
        base_s = eff.step_overhead_s + eff.per_seq_overhead_s * rows
        allreduce_s = self.allreduce_s(rows)
        pair_flops_per, kv_bytes_per = d.pair_flops, d.kv_bytes
        times = []
        for c in num_cached:
            pair_flops = pair_flops_per * (c + rows)  # each row attends its cache plus itself
            kv_bytes = kv_bytes_per * (c + rows)
            attn_flops, attn_bytes = float(pair_flops), float(kv_bytes)
            dense_s = max((float(row_flops + pair_flops) - attn_flops) / gemm_rate,
                          (weight_bytes + kv_bytes - attn_bytes) / bytes_rate)
            roof_s = dense_s + max(attn_flops / flops_rate, attn_bytes / kv_rate)
            times.append(base_s + roof_s + allreduce_s)
        return times

    @cached_property
    def _dense(self) -> DenseStepWork | None:
        """The closed-form FLOP/byte counter when the model is dense (the common case)."""
        cfg = self.model
        if cfg.is_moe or cfg.is_dual_flow:
            return None
        return DenseStepWork(cfg, self._weight_b, self._kv_b)

    @cached_property
    def _rates(self) -> tuple[float, float, float]:
        """FLOP/s, weight bytes/s and KV bytes/s this replica reaches (efficiency applied)."""
        eff, hw, tp = self.efficiency, self.hardware, self.tp
        flops_rate = tp * hw.peak_flops_per_s(self.dtype) * eff.flops_fraction
        bytes_rate = tp * hw.mem_bandwidth_bytes_per_s * eff.bandwidth_fraction
        kv_frac = eff.kv_bandwidth_fraction or eff.bandwidth_fraction
        return flops_rate, bytes_rate, tp * hw.mem_bandwidth_bytes_per_s * kv_frac

    def _time_of(self, w: StepWork) -> StepTime:
        eff = self.efficiency
        flops_rate, bytes_rate, kv_rate = self._rates
        rows = w.num_tokens
        gemm_rate = flops_rate * rows / (rows + eff.gemm_half_tokens) if rows else flops_rate
        dense_s = max((w.flops - w.attn_flops) / gemm_rate, (w.bytes - w.attn_bytes) / bytes_rate)
        roof_s = dense_s + max(w.attn_flops / flops_rate, w.attn_bytes / kv_rate)
        total = eff.step_overhead_s + eff.per_seq_overhead_s * w.num_seqs + roof_s
        if w.prefill_flops > 0:
            total += eff.prefill_step_overhead_s
        total += self.allreduce_s(rows)
        pre_s = max(w.prefill_flops / flops_rate, w.prefill_bytes / bytes_rate)
        dec_s = max(w.decode_flops / flops_rate, w.decode_bytes / bytes_rate)
        share = pre_s / (pre_s + dec_s) if pre_s + dec_s > 0 else 0.0
        return StepTime(total, share)

    @cached_property
    def _tp_link(self) -> LinkSpec | None:
        return self._link()

    def allreduce_s(self, num_tokens: int) -> float:
        """Two ring all-reduces of the hidden states per layer (Megatron-style TP)."""
        if self.tp == 1 or num_tokens == 0:
            return 0.0
        link = self._tp_link
        if link is None:
            return 0.0
        size = num_tokens * self.model.d_model * self.dtype_bytes
        one = 2 * (self.tp - 1) / self.tp * size / link.bytes_per_s + link.latency_s
        return 2 * self.model.n_layers * one

    def kv_transfer_s(self, num_tokens: int, link: LinkSpec) -> float:
        """Time to send `num_tokens` tokens of KV from a prefill to a decode replica."""
        return link.transfer_s(num_tokens * self.kv_bytes_per_token())
