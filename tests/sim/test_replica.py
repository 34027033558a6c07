"""The simulator's replica is the engine's scheduler: same classes, same batches step by step."""

from __future__ import annotations

import subprocess
import sys

import pytest

from splitphase.engine.block_manager import BlockManager
from splitphase.engine.config import EngineConfig
from splitphase.engine.llm_engine import LLMEngine
from splitphase.engine.request import Request
from splitphase.engine.sampling_params import SamplingParams
from splitphase.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from splitphase.hardware.specs import get_hardware
from splitphase.model.config import ModelConfig
from splitphase.sim.cost_model import CostModel
from splitphase.sim.replica import Replica, StepSummary, prompt_token_ids
from splitphase.sim.workload import SimRequest


def test_replica_runs_the_engine_classes() -> None:
    sc = SchedulerConfig(policy="chunked", num_blocks=8, max_num_seqs=4,
                         max_num_batched_tokens=64)
    r = Replica("c0", sc, CostModel(ModelConfig.from_name("tiny"), get_hardware("h100")))
    assert type(r.scheduler) is Scheduler
    assert type(r.scheduler.block_manager) is BlockManager


def test_simulator_imports_no_torch() -> None:
    code = ("import sys; import splitphase.sim.planner, splitphase.sim.simulator, "
            "splitphase.sim.workload; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def _prompts(n: int, vocab: int) -> list[list[int]]:
    lens = [37, 5, 90, 16, 61, 23, 120, 8]
    return [[(i * 131 + j * 7) % (vocab - 2) + 1 for j in range(lens[i % len(lens)])]
            for i in range(n)]


def _engine_steps(engine: LLMEngine) -> list[SchedulerOutput]:
    seen: list[SchedulerOutput] = []
    orig = engine.scheduler.schedule

    def record(now_s: float) -> SchedulerOutput:
        out = orig(now_s)
        if out.num_seqs:
            seen.append(out)
        return out

    engine.scheduler.schedule = record  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("fast_forward", [False, True])  # True: decode runs log every step too
@pytest.mark.parametrize(
    ("policy", "num_blocks", "budget"),
    [("chunked", 64, 48), ("mixed", 64, 160), ("chunked", 14, 64)],  # the last one preempts
)
def test_replica_reproduces_engine_schedule(tiny_model, tokenizer, policy, num_blocks, budget,
                                            fast_forward):
    engine = LLMEngine(tiny_model, tokenizer, EngineConfig(
        policy=policy, max_num_seqs=4, max_num_batched_tokens=budget, block_size=16,
        num_blocks=num_blocks))
    seen = _engine_steps(engine)
    prompts = _prompts(8, tiny_model.cfg.vocab_size)
    outputs = [12, 30, 4, 25, 9, 17, 6, 20]
    for i, (ids, n) in enumerate(zip(prompts, outputs, strict=True)):
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        engine.add_request(ids, sp, request_id=f"r{i}", arrival_s=0.0)
    while engine.has_unfinished_requests():
        engine.step()
    real = [StepSummary.of(o, 0.0) for o in seen]

    replica = Replica("c0", engine.scheduler.config, CostModel(tiny_model.cfg,
                                                                 get_hardware("h100")),
                      record_steps=True, fast_forward=fast_forward)
    for i, (ids, n) in enumerate(zip(prompts, outputs, strict=True)):
        replica.add(Request(f"r{i}", ids, SamplingParams(max_tokens=n, ignore_eos=True), 0.0))
    now, num_events = 0.0, 0
    while True:
        end = replica.start_step(now)
        if end is None:
            break
        while (more := replica.continue_run(end)) is not None:  # a decode run's next stretch
            end = more
        replica.finish_step(end)
        now, num_events = end, num_events + 1
    assert replica.steps is not None
    simulated = [StepSummary(s.step_id, s.chunks, s.decodes, s.preempted, 0.0)
                 for s in replica.steps]
    assert len(simulated) == len(real) > 8
    assert (num_events < len(real)) == fast_forward  # decode runs took several steps at once
    assert [(s.chunks, s.decodes, s.preempted) for s in simulated] == [
        (s.chunks, s.decodes, s.preempted) for s in real]
    if num_blocks == 14:
        assert any(s.preempted for s in real), "the small pool should force a preemption"


def test_prompt_ids_share_trace_prefix_blocks() -> None:
    a = SimRequest(0, 0.0, 600, 5, (7, 8))
    b = SimRequest(1, 0.0, 700, 5, (7, 9))
    c = SimRequest(2, 0.0, 600, 5)
    ia, ib, ic = prompt_token_ids(a), prompt_token_ids(b), prompt_token_ids(c)
    assert len(ia) == 600 and len(ib) == 700 and len(ic) == 600
    assert ia[:512] == ib[:512] and ia[512:] != ib[512:600]
    assert not set(ic) & set(ia)


def test_prefill_replica_reproduces_the_prefill_worker_schedule(tiny_model, tokenizer) -> None:
    engine = LLMEngine(tiny_model, tokenizer, EngineConfig(
        policy="disaggregated", role="prefill", max_num_seqs=4, max_num_batched_tokens=40,
        block_size=16, num_blocks=40))
    seen = _engine_steps(engine)
    prompts = _prompts(8, tiny_model.cfg.vocab_size)
    for i, ids in enumerate(prompts):
        sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        engine.add_request(ids, sp, request_id=f"r{i}", arrival_s=0.0)
    handed = []
    while engine.scheduler.has_unfinished_requests():
        engine.step()
        handed += [h.request.request_id for h in engine.pop_handoffs()]  # as the worker loop
    real = [(StepSummary.of(o, 0.0).chunks, o.num_decode_seqs) for o in seen]

    replica = Replica("p0", engine.scheduler.config,
                      CostModel(tiny_model.cfg, get_hardware("h100")), record_steps=True)
    for i, ids in enumerate(prompts):
        replica.add(Request(f"r{i}", ids, SamplingParams(max_tokens=8, ignore_eos=True), 0.0))
    now, sim_handed = 0.0, []
    while (end := replica.start_step(now)) is not None:
        _, handoffs = replica.finish_step(end)
        for h in handoffs:  # released at once, as LLMEngine.pop_handoffs does after export
            replica.scheduler.release_handoff(h.request.request_id)
            sim_handed.append(h.request.request_id)
        now = end
    assert replica.steps is not None
    assert [(s.chunks, len(s.decodes)) for s in replica.steps] == real and len(real) > 4
    assert sim_handed == handed and len(handed) == 8
