"""Scheduler: each policy against a fake paged model, preemption, abort, disaggregation, limits.

The fake model writes (position, token) into the slots the scheduler names, reads its whole
context back through the block table (so a wrong table, prefix hit or missing block copy shows
up as a wrong context), and samples a deterministic function of that context, like greedy
decoding: recompute after preemption must then give identical tokens.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitphase.engine.block_manager import slots_from_block_table
from splitphase.engine.request import Request, RequestStatus
from splitphase.engine.sampling_params import SamplingParams
from splitphase.engine.scheduler import (
    Handoff,
    Scheduler,
    SchedulerConfig,
    SchedulerError,
    SchedulerOutput,
)

VOCAB = 40
EOS = 0


def next_token(context: Sequence[int], sample_index: int = 0) -> int:
    """The fake model's 'greedy' choice: a hash of the whole context."""
    h = 17
    for t in context:
        h = (h * 131 + t + 1) % 1_000_003
    return (h + 7 * sample_index) % VOCAB


class FakeModel:
    """A paged KV memory plus next_token; checks every context against the request's tokens."""

    def __init__(self, config: SchedulerConfig):
        self.block_size = config.block_size
        self.kv: list[tuple[int, int] | None] = [None] * (config.num_blocks * config.block_size)

    def _slots(self, table: Sequence[int], start: int, end: int) -> list[int]:
        return slots_from_block_table(table, self.block_size, start, end)

    def _read(self, table: Sequence[int], n: int) -> list[int]:
        context = []
        for pos, slot in enumerate(self._slots(table, 0, n)):
            entry = self.kv[slot]
            assert entry is not None and entry[0] == pos, f"slot {slot} holds {entry}, wanted {pos}"
            context.append(entry[1])
        return context

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        bs = self.block_size
        for src, dst in copies:
            self.kv[dst * bs : (dst + 1) * bs] = self.kv[src * bs : (src + 1) * bs]

    def execute(self, out: SchedulerOutput, sched: Scheduler) -> dict[str, list[int]]:
        """Copies, then every write of the step, then the reads and samples (as a real model)."""
        self.copy_blocks(out.block_copies)
        for c in out.prefill:
            for pos, slot, tok in zip(range(c.start, c.end), self._slots(c.block_table, c.start,
                                      c.end), c.token_ids, strict=True):
                self.kv[slot] = (pos, tok)
        for d in out.decode:
            slot = self._slots(d.block_table, d.position, d.context_len)[0]
            self.kv[slot] = (d.position, d.token_id)
        sampled: dict[str, list[int]] = {}
        for c in out.prefill:
            req = sched.get_request(c.request_id)
            assert req is not None and list(c.token_ids) == req.get_token_ids(c.start, c.end)
            if c.num_samples:
                ctx = self._read(c.block_table, c.end)
                assert ctx == req.all_token_ids[: c.end]
                sampled[c.request_id] = [next_token(ctx, i) for i in range(c.num_samples)]
        for d in out.decode:
            req = sched.get_request(d.request_id)
            ctx = self._read(d.block_table, d.context_len)
            assert req is not None and ctx == req.all_token_ids
            sampled[d.request_id] = [next_token(ctx)]
        return sampled


@dataclass
class Spec:
    """One request of a workload: when it arrives (step) and what it asks for."""

    arrival_step: int
    prompt: list[int]
    max_tokens: int = 8
    n: int = 1
    ignore_eos: bool = True
    abort_step: int | None = None

    def make(self, rid: str) -> Request:
        sp = SamplingParams(max_tokens=self.max_tokens, n=self.n, ignore_eos=self.ignore_eos)
        return Request(rid, self.prompt, sp, arrival_time_s=float(self.arrival_step))


@dataclass
class Run:
    outputs: dict[str, list[int]] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    steps: list[SchedulerOutput] = field(default_factory=list)
    requests: dict[str, Request] = field(default_factory=dict)


def check_step(out: SchedulerOutput, cfg: SchedulerConfig) -> None:
    assert out.num_seqs <= cfg.max_num_seqs
    assert out.num_batched_tokens <= cfg.max_num_batched_tokens
    ids = [c.request_id for c in out.prefill] + [d.request_id for d in out.decode]
    assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
    for c in out.prefill:
        assert c.num_tokens >= 1 and (c.num_samples > 0) == c.is_last_chunk
        if cfg.long_prefill_token_threshold is not None:
            assert c.num_tokens <= cfg.long_prefill_token_threshold


def finish_run(run: Run, finished: list[Request]) -> None:
    for r in finished:
        run.outputs[r.request_id] = list(r.output_token_ids)
        run.reasons[r.request_id] = r.finish_reason or ""


def run_single(cfg: SchedulerConfig, specs: Sequence[Spec], max_steps: int = 5000) -> Run:
    """Drive one Scheduler to completion with the fake model."""
    sched, model, run = Scheduler(cfg), FakeModel(cfg), Run()
    step = 0
    while step < max_steps:
        for i, s in enumerate(specs):
            if s.arrival_step == step:
                run.requests[f"r{i}"] = req = s.make(f"r{i}")
                sched.add_request(req)
            if s.abort_step == step and sched.abort_request(f"r{i}", float(step)) is not None:
                run.reasons[f"r{i}"] = "abort"
        if not sched.has_unfinished_requests() and step > max(s.arrival_step for s in specs):
            break
        out = sched.schedule(float(step))
        check_step(out, cfg)
        run.steps.append(out)
        sampled = model.execute(out, sched)
        finish_run(run, sched.update_from_output(out, sampled, float(step) + 1))
        sched.block_manager.check_invariants()
        step += 1
    assert not sched.has_unfinished_requests(), "requests left unfinished"
    assert sched.block_manager.num_free_blocks == cfg.num_blocks, "blocks leaked"
    collect_children(run)
    return run


def collect_children(run: Run) -> None:
    for req in list(run.requests.values()):
        for child in req.children:
            run.requests[child.request_id] = child
    for rid, req in run.requests.items():
        assert req.is_finished, f"{rid} ended as {req.status}"


def cfg_of(policy: str = "chunked", **kw: object) -> SchedulerConfig:
    base: dict[str, object] = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "block_size": 4,
                               "num_blocks": 64, "max_model_len": 64, "eos_token_id": EOS}
    base.update(kw)
    return SchedulerConfig(policy=policy, **base)  # type: ignore[arg-type]


def reference(specs: Sequence[Spec], max_model_len: int = 64) -> dict[str, list[int]]:
    """Unconstrained run: a big pool, no prefix cache, no aborts."""
    clean = [Spec(s.arrival_step, s.prompt, s.max_tokens, s.n, s.ignore_eos) for s in specs]
    cfg = cfg_of("chunked", num_blocks=512, max_num_seqs=64, max_model_len=max_model_len,
                 max_num_batched_tokens=1024, enable_prefix_caching=False)
    return run_single(cfg, clean).outputs


WORKLOAD = [
    Spec(0, list(range(1, 11)), max_tokens=6),
    Spec(1, list(range(1, 11)) + [5, 5, 5], max_tokens=9),  # shares a prefix with r0
    Spec(1, [3] * 27, max_tokens=4),
    Spec(2, [9, 8, 7], max_tokens=12, n=3),
    Spec(3, list(range(20, 40)), max_tokens=7),
    Spec(5, [1, 2, 3, 4, 5, 6, 7, 8], max_tokens=5, n=2),
]


# ---- config -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"policy": "fifo"}, "policy must be one of"),
        ({"policy": "disaggregated"}, "two schedulers"),
        ({"policy": "chunked", "role": "prefill"}, "two schedulers"),
        ({"policy": "disaggregated", "role": "both"}, "two schedulers"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_seqs": 64, "max_num_batched_tokens": 32}, "must be >= max_num_seqs"),
        ({"policy": "mixed", "long_prefill_token_threshold": 8}, "whole prompts"),
        ({"max_model_len": 10_000}, "KV pool"),
        ({"policy": "mixed", "max_model_len": 64, "max_num_batched_tokens": 32}, "whole"),
        ({"eos_token_id": -1}, "eos_token_id"),
        ({"block_size": True}, "block_size"),
    ],
)
def test_bad_configs(kwargs: dict[str, object], fragment: str) -> None:
    base: dict[str, object] = {"num_blocks": 16, "block_size": 4, "max_num_seqs": 8,
                               "max_num_batched_tokens": 32}
    base.update(kwargs)
    with pytest.raises(SchedulerError, match=fragment):
        SchedulerConfig(**base)  # type: ignore[arg-type]


def test_default_max_model_len() -> None:
    assert SchedulerConfig(num_blocks=10, block_size=4).max_model_len == 40
    mixed = SchedulerConfig(policy="mixed", num_blocks=100, block_size=4, max_num_seqs=8,
                            max_num_batched_tokens=64)
    assert mixed.max_model_len == 64


def test_add_request_errors() -> None:
    s = Scheduler(cfg_of(max_model_len=16))
    s.add_request(Request("a", [1]))
    with pytest.raises(SchedulerError, match="already in use"):
        s.add_request(Request("a", [2]))
    with pytest.raises(SchedulerError, match="max_model_len"):
        s.add_request(Request("b", [1] * 17))
    with pytest.raises(SchedulerError, match="add_prefilled_request"):
        s.add_prefilled_request(Request("c", [1]))
    out = s.schedule(0.0)
    with pytest.raises(SchedulerError, match="in flight"):
        s.schedule(0.0)
    with pytest.raises(SchedulerError, match="sampled token"):
        s.update_from_output(out, {}, 1.0)


# ---- policies -----------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["mixed", "chunked"])
def test_policies_match_the_reference_tokens(policy: str) -> None:
    run = run_single(cfg_of(policy), WORKLOAD)
    assert run.outputs == reference(WORKLOAD)
    assert len(run.outputs) == 6 + 2 + 1  # n=3 and n=2 add three children
    assert run.reasons["r3#2"] == "length" and len(run.outputs["r3#1"]) == 12


def test_mixed_runs_whole_prompts_with_decodes() -> None:
    run = run_single(cfg_of("mixed"), WORKLOAD)
    for out in run.steps:
        assert all(c.is_last_chunk for c in out.prefill)
    assert any(out.phase == "mixed" for out in run.steps)
    starts = {c.request_id: c.start for out in run.steps for c in out.prefill}
    assert starts["r1"] == 8  # the shared prefix of r0 came from the cache


def test_chunked_gives_decodes_priority_and_splits_long_prompts() -> None:
    specs = [Spec(0, [1, 2, 3], max_tokens=30), Spec(0, [4, 5], max_tokens=30),
             Spec(3, list(range(1, 61)), max_tokens=2)]
    cfg = cfg_of("chunked", max_num_batched_tokens=16, long_prefill_token_threshold=12)
    run = run_single(cfg, specs)
    long_chunks = [
        (i, c) for i, o in enumerate(run.steps) for c in o.prefill if c.request_id == "r2"
    ]
    assert len(long_chunks) == 5 and sum(c.num_tokens for _, c in long_chunks) == 60
    assert [c.is_last_chunk for _, c in long_chunks] == [False] * 4 + [True]
    for i, _ in long_chunks:  # both decoders decode in every step of the long prompt
        assert {d.request_id for d in run.steps[i].decode} == {"r0", "r1"}
        assert run.steps[i].phase == "mixed"
    assert run.outputs == reference(specs)


def test_chunk_positions_are_contiguous() -> None:
    run = run_single(cfg_of("chunked", max_num_batched_tokens=8), [Spec(0, list(range(1, 30)))])
    chunks = [c for o in run.steps for c in o.prefill]
    assert [c.start for c in chunks] == [0, 8, 16, 24]
    assert chunks[-1].end == 29 and chunks[-1].num_samples == 1


# ---- preemption, abort, stop --------------------------------------------------------------
@pytest.mark.parametrize("policy", ["mixed", "chunked"])
@pytest.mark.parametrize("caching", [True, False])
def test_preemption_with_a_tiny_pool_gives_identical_tokens(policy: str, caching: bool) -> None:
    cfg = cfg_of(policy, num_blocks=12, max_model_len=32, enable_prefix_caching=caching)
    specs = [Spec(0, list(range(1, 9)), max_tokens=20), Spec(0, [7] * 6, max_tokens=18),
             Spec(1, [2, 3, 4, 5, 6], max_tokens=16, n=2), Spec(2, [8] * 10, max_tokens=12)]
    run = run_single(cfg, specs)
    assert any(o.preempted_request_ids for o in run.steps), "the pool should force preemption"
    assert run.outputs == reference(specs)
    assert any(r.num_preemptions for r in run.requests.values())


def test_preempted_request_goes_to_the_front_as_preempted() -> None:
    cfg = cfg_of("chunked", num_blocks=4, max_model_len=16, max_num_seqs=2,
                 max_num_batched_tokens=16)
    s, model = Scheduler(cfg), FakeModel(cfg)
    sp = SamplingParams(ignore_eos=True)
    old, young = Request("old", [1] * 4, sp, 0.0), Request("young", [2] * 4, sp, 1.0)
    s.add_request(old)
    s.add_request(young)
    for step in range(8):  # position 8 (step 5) needs a third block each: only "old" gets it
        out = s.schedule(float(step))
        s.update_from_output(out, model.execute(out, s), step + 1.0)
        if young.num_preemptions:
            break
    assert out.preempted_request_ids == ("young",) and [d.request_id for d in out.decode] == ["old"]
    assert young.status is RequestStatus.PREEMPTED and young.num_computed_tokens == 0
    assert young.block_table == [] and s.waiting[0] is young and old.status is RequestStatus.RUNNING
    assert young.prefill_len == young.num_tokens and young.num_output_tokens > 0


def test_abort_frees_blocks_in_any_state() -> None:
    cfg = cfg_of("chunked", max_num_batched_tokens=8)
    s, model = Scheduler(cfg), FakeModel(cfg)
    s.add_request(Request("run", list(range(1, 20))))
    s.add_request(Request("wait", [1, 2]))
    out = s.schedule(0.0)  # "run" is mid-prompt, "wait" waits
    sampled = model.execute(out, s)
    assert s.block_manager.num_used_blocks > 0
    aborted = s.abort_request("run", 0.5)
    assert aborted is not None and aborted.status is RequestStatus.FINISHED_ABORTED
    assert aborted.finish_reason == "abort" and aborted.block_table == []
    assert s.block_manager.num_used_blocks == 0
    assert s.update_from_output(out, sampled, 1.0) == []  # the aborted one is skipped
    assert s.abort_request("wait", status=RequestStatus.FINISHED_ERROR).finish_reason == "error"
    assert s.abort_request("nope") is None and not s.has_unfinished_requests()
    with pytest.raises(SchedulerError):
        s.abort_request("x", status=RequestStatus.RUNNING)


def test_stop_rules() -> None:
    prompt = [5, 6, 7]
    first = next_token(prompt)
    cfg = cfg_of(eos_token_id=first)
    run = run_single(cfg, [Spec(0, prompt, ignore_eos=False), Spec(0, prompt, ignore_eos=True,
                                                                    max_tokens=3)])
    assert run.outputs["r0"] == [first] and run.reasons["r0"] == "stop"
    assert len(run.outputs["r1"]) == 3 and run.reasons["r1"] == "length"

    s, model = Scheduler(cfg_of()), FakeModel(cfg_of())
    s.add_request(Request("ids", prompt, SamplingParams(stop_token_ids=[first])))
    s.add_request(Request("cb", [1, 2], SamplingParams(max_tokens=50, ignore_eos=True)))
    s.add_request(Request("own", prompt, eos_token_id=first))
    done: list[Request] = []
    t = 0.0
    while s.has_unfinished_requests():
        out = s.schedule(t)
        done += s.update_from_output(out, model.execute(out, s), t + 1,
                                     stop_checker=lambda r: r.num_output_tokens == 4)
        t += 1
    by_id = {r.request_id: r for r in done}
    assert by_id["ids"].output_token_ids == [first] and by_id["ids"].finish_reason == "stop"
    assert by_id["own"].num_output_tokens == 1
    assert by_id["cb"].num_output_tokens == 4 and by_id["cb"].finish_reason == "stop"


def test_max_model_len_caps_output() -> None:
    run = run_single(cfg_of(max_model_len=12), [Spec(0, [1] * 10, max_tokens=50)])
    assert len(run.outputs["r0"]) == 2 and run.reasons["r0"] == "length"


def test_fork_copies_the_partial_block_and_timings_follow_the_caller() -> None:
    run = run_single(cfg_of(), [Spec(0, [1, 2, 3, 4, 5, 6], max_tokens=3, n=2)])
    copies = [cp for o in run.steps for cp in o.block_copies]
    assert len(copies) == 1  # 6 tokens: one shared full block, one copied partial block
    parent, child = run.requests["r0"], run.requests["r0#1"]
    assert child.parent_id == "r0" and child.sample_index == 1 and parent.children == [child]
    assert parent.output_token_ids[0] != child.output_token_ids[0]
    assert parent.ttft_s == child.ttft_s == 1.0 and parent.queue_s == 0.0
    assert parent.token_times_s == [1.0, 2.0, 3.0] and parent.tpot_s == 1.0


# ---- disaggregation -------------------------------------------------------------------------
def run_disaggregated(specs: Sequence[Spec], p_cfg: SchedulerConfig,
                      d_cfg: SchedulerConfig) -> Run:
    """Two schedulers, two KV memories; a KV 'transfer' copies slots between them."""
    pre, dec = Scheduler(p_cfg), Scheduler(d_cfg)
    p_model, d_model, run = FakeModel(p_cfg), FakeModel(d_cfg), Run()
    in_transit: dict[str, Handoff] = {}
    for step in range(5000):
        for i, s in enumerate(specs):
            if s.arrival_step == step:
                run.requests[f"r{i}"] = req = s.make(f"r{i}")
                pre.add_request(req)
        busy = pre.has_unfinished_requests() or dec.has_unfinished_requests() or in_transit
        if not busy and step > max(s.arrival_step for s in specs):
            break
        out = pre.schedule(float(step))
        check_step(out, p_cfg)
        assert not out.decode
        finish_run(run, pre.update_from_output(out, p_model.execute(out, pre), step + 1.0))
        for h in pre.pop_handoffs():
            in_transit[h.request.request_id] = h
            dec.add_prefilled_request(h.request)
        out = dec.schedule(float(step))
        check_step(out, d_cfg)
        assert not out.prefill
        for load in out.kv_loads:  # pull KV before the forward pass
            src = in_transit[load.request_id].block_table
            span = (load.start, load.start + load.num_tokens)
            for s_slot, d_slot in zip(
                slots_from_block_table(src, p_cfg.block_size, *span),
                slots_from_block_table(load.block_table, d_cfg.block_size, *span), strict=True
            ):
                d_model.kv[d_slot] = p_model.kv[s_slot]
        for d in out.decode:  # admitted: the prefill worker may drop its copy
            if d.request_id in in_transit:
                pre.release_handoff(in_transit.pop(d.request_id).request.request_id)
        finish_run(run, dec.update_from_output(out, d_model.execute(out, dec), step + 1.0))
        for h in dec.pop_handoffs():  # preempted on the decode worker: prefill again
            assert h.block_table == () and h.request.status is RequestStatus.PREEMPTED
            pre.add_request(h.request)
        pre.block_manager.check_invariants()
        dec.block_manager.check_invariants()
    assert not in_transit and not pre.has_unfinished_requests()
    assert not dec.has_unfinished_requests()
    assert pre.block_manager.num_free_blocks == p_cfg.num_blocks
    assert dec.block_manager.num_free_blocks == d_cfg.num_blocks
    collect_children(run)
    return run


@pytest.mark.parametrize("d_blocks", [64, 12])
def test_disaggregated_workers_match_the_reference(d_blocks: int) -> None:
    p_cfg = cfg_of("disaggregated", role="prefill", max_num_batched_tokens=16)
    d_cfg = cfg_of("disaggregated", role="decode", num_blocks=d_blocks, max_model_len=40,
                   block_size=8)
    specs = [Spec(s.arrival_step, s.prompt, min(s.max_tokens, 5), s.n) for s in WORKLOAD[:4]]
    specs += [Spec(4, [7] * 6, max_tokens=20)]
    run = run_disaggregated(specs, p_cfg, d_cfg)
    assert run.outputs == reference(specs, max_model_len=40)


def test_role_checks() -> None:
    dec = Scheduler(cfg_of("disaggregated", role="decode"))
    with pytest.raises(SchedulerError, match="add_prefilled_request"):
        dec.add_request(Request("a", [1]))
    with pytest.raises(SchedulerError, match="not prefilled"):
        dec.add_prefilled_request(Request("a", [1]))
    pre = Scheduler(cfg_of("disaggregated", role="prefill"))
    with pytest.raises(SchedulerError, match="not a popped handoff"):
        pre.release_handoff("a")


# ---- random workloads -----------------------------------------------------------------------
spec_strategy = st.builds(
    Spec,
    arrival_step=st.integers(0, 12),
    prompt=st.one_of(
        st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=24),
        st.integers(1, 16).map(lambda k: list(range(1, 9)) + [k] * (k % 5)),  # shared prefix
    ),
    max_tokens=st.integers(1, 14),
    n=st.sampled_from([1, 1, 1, 2, 3]),
    ignore_eos=st.booleans(),
    abort_step=st.one_of(st.none(), st.integers(0, 30)),
)


@settings(max_examples=60, deadline=None)
@given(
    specs=st.lists(spec_strategy, min_size=1, max_size=7),
    policy=st.sampled_from(["mixed", "chunked"]),
    num_blocks=st.integers(10, 40),
    max_num_seqs=st.integers(1, 6),
    caching=st.booleans(),
)
def test_random_workloads_terminate_without_leaks(
    specs: list[Spec], policy: str, num_blocks: int, max_num_seqs: int, caching: bool
) -> None:
    cfg = cfg_of(policy, num_blocks=num_blocks, max_num_seqs=max_num_seqs, max_model_len=40,
                 max_num_batched_tokens=40, enable_prefix_caching=caching)
    run = run_single(cfg, specs)  # asserts: limits, invariants, terminal states, no leak
    ref = reference(specs, max_model_len=40)
    for rid, tokens in run.outputs.items():
        if run.reasons.get(rid) != "abort":
            assert tokens == ref[rid]


@settings(max_examples=30, deadline=None)
@given(specs=st.lists(spec_strategy, min_size=1, max_size=5), d_blocks=st.integers(10, 30))
def test_random_disaggregated_workloads(specs: list[Spec], d_blocks: int) -> None:
    specs = [Spec(s.arrival_step, s.prompt, s.max_tokens, s.n, s.ignore_eos) for s in specs]
    p_cfg = cfg_of("disaggregated", role="prefill", max_num_batched_tokens=16, num_blocks=40,
                   max_model_len=40)
    d_cfg = cfg_of("disaggregated", role="decode", num_blocks=d_blocks, max_model_len=40)
    assert run_disaggregated(specs, p_cfg, d_cfg).outputs == reference(specs, max_model_len=40)


def test_bookkeeping_imports_no_torch() -> None:
    code = (
        "import sys, splitphase.engine.scheduler, splitphase.engine.block_manager, "
        "splitphase.engine.request, splitphase.engine.sampling_params, "
        "splitphase.engine.policies; assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
