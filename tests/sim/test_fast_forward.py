"""Fast-forwarded decode runs simulate exactly what stepping every decode simulates."""

from __future__ import annotations

import pytest

from splitphase.engine.scheduler import SchedulerConfig, SchedulerOutput
from splitphase.hardware.specs import get_hardware
from splitphase.model.config import ModelConfig
from splitphase.sim.cluster import ClusterConfig, PoolConfig
from splitphase.sim.simulator import SimResult, Simulation
from splitphase.sim.workload import SimRequest, parse_workload

CFG = ModelConfig.from_name("llama-3.1-8b")
HW = get_hardware("h100-sxm")


def _sched(policy: str = "chunked", role: str | None = None, num_blocks: int = 4000,
           prefix: bool = False, seqs: int = 32) -> SchedulerConfig:
    return SchedulerConfig(policy=policy, role=role, max_num_seqs=seqs,
                           max_num_batched_tokens=2048, num_blocks=num_blocks,
                           enable_prefix_caching=prefix)


def _twins(n: int) -> list[SimRequest]:
    """Requests sharing prompt blocks (and, sampling one token id, output blocks too)."""
    return [SimRequest(i, 0.05 * i, 700 + 16 * (i % 3), 40 + 23 * (i % 5), (1, 2))
            for i in range(n)]


CASES = {
    "chunked": (ClusterConfig(colocated=PoolConfig(2, 1, _sched())),
                parse_workload("chat").with_rate(12).generate(60, 3, 2048)),
    # 60 blocks of 16 tokens hold about two requests: decodes preempt and the queue waits.
    "preempting": (ClusterConfig(colocated=PoolConfig(1, 1, _sched(num_blocks=60))),
                   parse_workload("poisson:20,prompt=uniform:100:400,output=uniform:50:300")
                   .generate(30, 4, 900)),
    "mixed": (ClusterConfig(colocated=PoolConfig(1, 1, _sched("mixed"))),
              parse_workload("chat").with_rate(5).generate(30, 5, 2048)),
    "prefix-twins": (ClusterConfig(colocated=PoolConfig(1, 1, _sched(num_blocks=150,
                                                                      prefix=True))),
                     _twins(24)),
    "disaggregated": (ClusterConfig(
        prefill=PoolConfig(1, 1, _sched("disaggregated", "prefill")),
        decode=PoolConfig(2, 1, _sched("disaggregated", "decode", num_blocks=120, seqs=8)),
        dispatch_s=0.002), parse_workload("chat").with_rate(8).generate(40, 6, 1500)),
}


def _run(cluster: ClusterConfig, reqs: list[SimRequest], fast_forward: bool
         ) -> tuple[SimResult, dict[str, dict[int, SchedulerOutput]], list[float]]:
    """Simulate with step logs; also keep every SchedulerOutput and the times runs were cut."""
    sim = Simulation(cluster, CFG, HW, record_steps=True, fast_forward=fast_forward)
    outputs: dict[str, dict[int, SchedulerOutput]] = {}
    cuts: list[float] = []
    for replica in sim.colocated + sim.prefill + sim.decode:
        orig_cut = replica.cut

        def cut(now_s: float, orig_cut=orig_cut) -> float | None:  # type: ignore[no-untyped-def]
            cuts.append(now_s)
            return orig_cut(now_s)

        replica.cut = cut  # type: ignore[method-assign]
        seen = outputs[replica.name] = {}
        orig = replica.scheduler.schedule

        def record(now_s: float, orig=orig, seen=seen) -> SchedulerOutput:  # type: ignore[no-untyped-def]
            out = orig(now_s)
            seen[out.step_id] = out
            return out

        replica.scheduler.schedule = record  # type: ignore[method-assign]
    return sim.run(reqs), outputs, cuts


@pytest.mark.parametrize("case", list(CASES))
def test_fast_forward_changes_nothing_but_the_work(case: str) -> None:
    cluster, reqs = CASES[case]
    slow, slow_outs, _ = _run(cluster, reqs, fast_forward=False)
    fast, fast_outs, cuts = _run(cluster, reqs, fast_forward=True)

    def timeline(res: SimResult) -> list[tuple[object, ...]]:
        return sorted((r.index, r.arrival_s, r.first_token_s, r.finished_s, r.prompt_len,
                       r.output_len, r.num_preemptions, r.ttft_s, r.tpot_s, r.e2e_s)
                      for r in res.records)

    assert len(slow.records) == len(reqs)
    assert timeline(fast) == timeline(slow)
    assert fast.makespan_s == slow.makespan_s and fast.kv_transfer_s == slow.kv_transfer_s
    assert (fast.prefill_gpu_s, fast.decode_gpu_s) == (slow.prefill_gpu_s, slow.decode_gpu_s)
    for a, b in zip(slow.replicas, fast.replicas, strict=True):
        assert (b.num_steps, b.busy_s, b.prefill_busy_s) == (a.num_steps, a.busy_s,
                                                             a.prefill_busy_s)
        assert b.steps == a.steps  # every step: id, chunks, decode rows, preemptions, time
        # Each step the scheduler still decided is the same output: tokens, block tables.
        fast_seen, slow_seen = fast_outs[b.name], slow_outs[a.name]
        assert all(out == slow_seen[sid] for sid, out in fast_seen.items())
    # The runs did skip scheduling: far fewer schedule() calls and events.
    assert sum(map(len, fast_outs.values())) < 0.6 * sum(map(len, slow_outs.values()))
    assert fast.events < slow.events
    assert cuts, "requests should arrive (or transfer in) while decode runs are in flight"
    if case == "preempting":
        assert any(r.num_preemptions for r in slow.records), "the pool should force preemption"
