"""The closed-form dense step work equals audit.flops's general formulas exactly."""

from __future__ import annotations

import random

import pytest

from splitphase.engine.policies import DecodeBatch, ScheduledChunk, SchedulerOutput
from splitphase.hardware.specs import get_hardware
from splitphase.model.config import ModelConfig
from splitphase.sim.cost_model import CostModel
from splitphase.sim.step_work import DenseStepWork, step_work

DENSE = [ModelConfig.from_name(n) for n in ("tiny", "llama-3.2-1b", "llama-3.1-8b")]
DENSE.append(ModelConfig.from_name("tiny").with_(qk_norm=True))


def _batches(seed: int, n: int) -> list[tuple[list[tuple[int, int]], list[int]]]:
    rng = random.Random(seed)
    out: list[tuple[list[tuple[int, int]], list[int]]] = [([], [])]
    for _ in range(n):
        chunks = [(rng.randint(1, 2048), rng.randint(0, 6000)) for _ in range(rng.randint(0, 3))]
        out.append((chunks, [rng.randint(0, 8000) for _ in range(rng.randint(0, 40))]))
    return out


@pytest.mark.parametrize("cfg", DENSE, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype_bytes", [1, 2, 4])
def test_dense_closed_form_equals_the_general_formulas_bit_for_bit(
    cfg: ModelConfig, dtype_bytes: int
) -> None:
    dense = DenseStepWork(cfg, dtype_bytes)
    for chunks, lens in _batches(dtype_bytes, 300):
        assert dense.work(chunks, len(lens), sum(lens)) == step_work(cfg, chunks, lens, dtype_bytes)


@pytest.mark.parametrize("cfg", DENSE[1:3], ids=lambda c: c.name)
def test_a_narrower_kv_cache_keeps_the_closed_form_exact(cfg: ModelConfig) -> None:
    dense = DenseStepWork(cfg, 2, kv_dtype_bytes=1)
    for chunks, lens in _batches(7, 100):
        assert dense.work(chunks, len(lens), sum(lens)) == step_work(cfg, chunks, lens, 2, 1)
    cm = CostModel(cfg, get_hardware("h100-sxm"), kv_dtype_bytes=1)
    positions = [17, 900, 4000]
    for k, t in zip(range(2, 9), cm.decode_steps_s(positions, 2, 8), strict=True):
        assert t == cm.step_time([], [p + k for p in positions]).total_s


def _decodes(cached_lens: list[int]) -> DecodeBatch:
    n = len(cached_lens)
    return DecodeBatch(("d",) * n, tuple(cached_lens), (0,) * n, ((),) * n)


@pytest.mark.parametrize("tp", [1, 2])
def test_step_time_of_an_output_equals_step_time_of_its_parts(tp: int) -> None:
    cm = CostModel(DENSE[2], get_hardware("h100-sxm"), tp)
    for i, (chunks, lens) in enumerate(_batches(10 + tp, 300)):
        out = SchedulerOutput(
            i, tuple(ScheduledChunk("c", b, n, False, 0, (), ()) for n, b in chunks),
            _decodes(lens), (), (), (), 16,
        )
        assert cm.step_time_of(out) == cm.step_time(chunks, lens)
        if lens:  # the decode-only fast path agrees with the general one
            dec = SchedulerOutput(i, (), _decodes(lens), (), (), (), 16)
            assert cm.step_time_of(dec) == cm.step_time([], lens)


def test_moe_and_dual_flow_keep_the_general_path() -> None:
    with pytest.raises(ValueError, match="dense"):
        DenseStepWork(ModelConfig.from_name("tiny-moe"), 2)
    cm = CostModel(ModelConfig.from_name("mixtral-8x7b"), get_hardware("h100-sxm"), 2)
    out = SchedulerOutput(0, (ScheduledChunk("c", 0, 512, True, 1, (), ()),),
                          _decodes([899]), (), (), (), 16)
    assert cm.step_time_of(out) == cm.step_time([(512, 0)], [899])


@pytest.mark.parametrize(("name", "tp"), [("llama-3.1-8b", 1), ("llama-3.1-8b", 2),
                                          ("mixtral-8x7b", 2)])
def test_a_decode_run_is_priced_as_its_steps(name: str, tp: int) -> None:
    cm = CostModel(ModelConfig.from_name(name), get_hardware("h100-sxm"), tp)
    positions = [17, 900, 4000, 63]
    times = cm.decode_steps_s(positions, 3, 40)
    assert len(times) == 38
    for k, t in zip(range(3, 41), times, strict=True):
        rows = [p + k for p in positions]
        out = SchedulerOutput(k, (), _decodes(rows), (), (), (), 16)
        assert t == cm.step_time_of(out).total_s == cm.step_time([], rows).total_s
