"""Disaggregated serving: two worker processes on this machine, checked against in-process runs."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from multiprocessing import Pipe

import pytest
import torch

from splitphase.audit.flops import step_cost
from splitphase.engine.async_engine import AsyncEngine
from splitphase.engine.config import EngineConfig
from splitphase.engine.disagg import DisaggConfig, DisaggregatedEngine, WorkerDiedError
from splitphase.engine.disagg_control import ControlServer, free_port
from splitphase.engine.disagg_frontend import FrontendState
from splitphase.engine.disagg_loops import _connect
from splitphase.engine.disagg_protocol import (
    ClockStamp,
    OutputRecord,
    WorkerUpdate,
    request_from_meta,
    request_meta,
    without_nagle,
)
from splitphase.engine.disagg_worker import WorkerOptions, add_worker_arguments, options_from_args
from splitphase.engine.llm import LLM
from splitphase.engine.llm_engine import LLMEngine, StepFailedError
from splitphase.engine.request import Request
from splitphase.engine.sampling_params import SamplingParams
from splitphase.errors import UserError
from splitphase.model.checkpoint import save_checkpoint

PROMPTS = [[0, *range(5, 5 + n)] for n in (3, 17, 40, 9, 33)]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SEEDED = [
    SamplingParams(max_tokens=10, temperature=0.9, top_k=40, seed=100 + i, ignore_eos=True)
    for i in range(len(PROMPTS))
]
LONG = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)


def run(engine, prompts, params=GREEDY, timeout_s=20.0):
    """Drive an engine to completion; finished outputs in prompt order."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
    done, deadline = {}, time.monotonic() + timeout_s
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine did not finish in time"
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


def step_until(engine, cond, timeout_s=10.0):
    """Step until cond(outputs so far by id) holds; returns the latest output per id."""
    latest, deadline = {}, time.monotonic() + timeout_s
    while not cond(latest):
        assert time.monotonic() < deadline, "condition not reached in time"
        for out in engine.step():
            latest[out.request_id] = out
    return latest


def assert_gone(pids):
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # the front end reaped it: no orphan, no zombie


@pytest.fixture(scope="module")
def mixed(tiny_model, tokenizer):
    def go(prompts, params=GREEDY):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # 2 shared cores: more threads only wait on each other
        try:
            with torch.inference_mode():
                cfg = EngineConfig(policy="mixed", num_blocks=64)
                return run(LLMEngine(tiny_model, tokenizer, cfg), prompts, params)
        finally:
            torch.set_num_threads(threads)

    return go


@pytest.fixture(scope="module")
def checkpoint(tiny_model, tmp_path_factory):
    return str(save_checkpoint(tiny_model, tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def pair(checkpoint):
    engine = DisaggregatedEngine(
        DisaggConfig(model=checkpoint, engine={"num_blocks": 64}, worker_threads=1)
    )
    yield engine
    pids = list(engine.worker_pids.values())
    engine.close()
    assert_gone(pids)


# ---- two processes ------------------------------------------------------------------------
def test_greedy_matches_mixed(pair, mixed):
    outs = run(pair, PROMPTS)
    assert [o.token_ids for o in outs] == [o.token_ids for o in mixed(PROMPTS)]
    assert [o.text for o in outs] == [o.text for o in mixed(PROMPTS)]
    assert all(o.finish_reason == "length" for o in outs)
    for o in outs:  # timings rebuilt on the front end's clock from both workers' records
        req = o.request
        assert 0 <= req.queue_s <= req.ttft_s and req.tpot_s > 0
        assert len(req.inter_token_s) == 11 and req.decode_s == pytest.approx(
            sum(req.inter_token_s)
        )
    assert (pair.kv_pool_blocks, pair.kv_block_size) == (64, 16)  # the decode worker's pool
    roles = {(s.role, s.phase) for s in pair.steps}
    assert ("prefill", "prefill") in roles and ("decode", "decode") in roles
    assert {r for r, _ in roles} == {"prefill", "decode"}
    with pytest.raises(UserError, match="context length"):
        pair.add_request([0] * 10, SamplingParams(max_tokens=pair.max_model_len))
    with pytest.raises(UserError, match="vocabulary"):
        pair.add_request([pair.vocab_size])


def test_seeded_sampling_matches_mixed(pair, mixed):
    outs = run(pair, PROMPTS, SEEDED)
    assert [o.token_ids for o in outs] == [o.token_ids for o in mixed(PROMPTS, SEEDED)]
    # The workers' admissions reach the front end: the 41-token prompt, prefilled before by
    # the test above, finds its two full blocks in the prefill worker's prefix cache.
    longest = outs[2].request
    assert longest.prefill_len == 41 and 32 <= longest.num_cached_tokens <= 40
    # The server counts lookups from the steps: the prefill worker's admissions only (the
    # decode worker's find K/V a transfer can skip, not a prompt the cache answers).
    looked_up = {role: sum(s.prefix_cache_queries_tokens for s in pair.steps if s.role == role)
                 for role in ("prefill", "decode")}
    assert looked_up["prefill"] >= sum(map(len, PROMPTS)) and looked_up["decode"] == 0
    assert sum(s.prefix_cache_hits_tokens for s in pair.steps) >= 32


@pytest.mark.parametrize(("kv_cache_dtype", "kv_bytes"), [("bfloat16", 2), ("fp8", 1)])
def test_a_narrower_pool_pair_matches_mixed_over_the_same_pool(
    checkpoint, tiny_model, tokenizer, kv_cache_dtype, kv_bytes
):
    # K/V leave the prefill worker's pool as its bytes and land in the decode worker's.
    engine = DisaggregatedEngine(DisaggConfig(
        model=checkpoint, engine={"num_blocks": 64, "kv_cache_dtype": kv_cache_dtype},
        worker_threads=1))
    try:
        run(engine, PROMPTS[1:2])
        first = next(s for s in engine.steps if s.role == "prefill")
        outs = run(engine, PROMPTS)
    finally:
        pids = list(engine.worker_pids.values())
        engine.close()
        assert_gone(pids)
    n = len(PROMPTS[1])  # the prefill worker charged its step its pool's K/V bytes
    assert first.num_prefill_tokens == n
    assert first.bytes == step_cost(tiny_model.cfg, [(n, 0)], [], 4,
                                    kv_dtype_bytes=kv_bytes).bytes
    with torch.inference_mode():
        cfg = EngineConfig(policy="mixed", num_blocks=64, kv_cache_dtype=kv_cache_dtype)
        want = run(LLMEngine(tiny_model, tokenizer, cfg), PROMPTS)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]


def test_abort_frees_blocks_on_both_workers(pair):
    a = pair.add_request(PROMPTS[2], LONG)
    step_until(pair, lambda seen: a in seen and len(seen[a].token_ids) >= 3)  # decoding now
    b = pair.add_request(PROMPTS[1], LONG)  # aborted before its prefill
    busy = pair.block_usage()
    assert busy["decode"]["num_used_blocks"] > 0
    pair.abort_request(a)
    pair.abort_request(b)
    ends = step_until(pair, lambda seen: a in seen and b in seen)
    assert ends[a].finish_reason == ends[b].finish_reason == "abort"
    assert len(ends[a].token_ids) < LONG.max_tokens
    assert not pair.has_unfinished_requests()
    # b's K/V may have been on the wire when the abort went out: the decode worker then adopts
    # it after the abort, and its adoption report draws a second abort. Blocks come back within
    # a few polls, bounded here.
    for _ in range(50):
        usage = pair.block_usage()
        if all(u["num_used_blocks"] == 0 for u in usage.values()):
            break
        pair.step()
    for role, u in usage.items():
        assert u["num_used_blocks"] == 0, role
        assert u["num_running"] == u["num_waiting"] == u["num_pending_kv"] == 0


def test_killed_prefill_worker_lets_the_decode_worker_finish(pair, mixed):
    a = pair.add_request(PROMPTS[0], LONG)
    step_until(pair, lambda seen: a in seen and len(seen[a].token_ids) >= 2)  # decoding now
    old = dict(pair.worker_pids)
    os.kill(old["prefill"], signal.SIGKILL)
    seen = step_until(pair, lambda seen: "prefill" in pair.dead_workers)
    assert a not in seen or not seen[a].finished  # noticed while the decode worker runs it
    end = step_until(pair, lambda seen: a in seen and seen[a].finished)[a]
    assert end.finish_reason == "length"
    assert end.token_ids == mixed(PROMPTS[:1], LONG)[0].token_ids
    with pytest.raises(WorkerDiedError, match="prefill worker"):
        pair.add_request(PROMPTS[0])
    pair.restart()
    assert_gone(old.values())


def test_killed_decode_worker_fails_its_requests_then_restart(pair, mixed):
    ids = [pair.add_request(p, LONG) for p in PROMPTS[:3]]
    step_until(
        pair,
        lambda seen: all(len(seen[i].token_ids) >= 2 for i in ids if i in seen) and len(seen) == 3,
    )
    old = dict(pair.worker_pids)
    os.kill(old["decode"], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(StepFailedError) as failed:
        step_until(pair, lambda seen: False, timeout_s=5.0)
    assert time.monotonic() - t0 < 5.0
    assert sorted(failed.value.request_ids) == sorted(ids)
    assert isinstance(failed.value.cause, WorkerDiedError)
    assert "SIGKILL" in str(failed.value.cause) or "connection" in str(failed.value.cause)
    assert not pair.has_unfinished_requests()
    with pytest.raises(WorkerDiedError, match="restart"):
        pair.add_request(PROMPTS[0])
    pair.restart()
    assert_gone(old.values())
    assert set(pair.worker_pids.values()).isdisjoint(old.values())
    outs = run(pair, PROMPTS[:2])
    assert [o.token_ids for o in outs] == [o.token_ids for o in mixed(PROMPTS[:2])]


def test_workers_started_by_hand_dial_in(checkpoint, mixed, monkeypatch):
    """The two-host recipe, on one host: `splitphase worker` processes, then the front end."""
    control, dist_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    monkeypatch.setenv("SPLITPHASE_AUTHKEY", "ab" * 16)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "splitphase.engine.disagg_worker",
                "--role",
                role,
                "--model",
                checkpoint,
                "--control",
                f"127.0.0.1:{control}",
                "--dist-init",
                f"tcp://127.0.0.1:{dist_port}",
                "--num-blocks",
                "64",
            ],
            stdin=subprocess.DEVNULL,
        )
        for role in ("decode", "prefill")  # any order: workers retry until the front end listens
    ]
    try:
        cfg = DisaggConfig(model=checkpoint, spawn_workers=False, control_port=control)
        with DisaggregatedEngine(cfg) as engine:
            outs = run(engine, PROMPTS[:2])
        assert [o.token_ids for o in outs] == [o.token_ids for o in mixed(PROMPTS[:2])]
        assert [p.wait(timeout=10) for p in procs] == [0, 0]  # close() shut them down
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


# ---- LLM(policy="disaggregated") and AsyncEngine, with decode-side preemption ---------------
# 4 blocks of 16: 14/30/14-token prompts fit together, then outgrow the decode pool together.
TIGHT = [[0, *range(5, 5 + n)] for n in (13, 29, 13)]


@pytest.fixture(scope="module")
def llm(tiny_model, tokenizer):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")  # the workers inherit it: one torch thread each
        llm = LLM(
            tiny_model, tokenizer, policy="disaggregated", num_blocks=4, max_num_batched_tokens=64
        )
    yield llm
    pids = list(llm.engine.worker_pids.values())
    llm.close()
    assert_gone(pids)


def test_llm_preempted_requests_are_prefilled_again(llm, mixed):
    # 24 new tokens each: any two requests decoding at once outgrow the 4-block pool (3 + 4
    # blocks, 3 + 3). Whether two ever decode at once depends on when each K/V arrives at
    # the decode worker (two processes): a fast host finished them in turn in 2 of 7 CI runs,
    # with 12 tokens and with 24. So up to three tries, each checked, at least one preempting.
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in mixed(TIGHT, params)]
    preempted = False
    for _ in range(3):
        outs = llm.generate(TIGHT, params)
        assert [o.token_ids for o in outs] == want
        assert all(o.timings.ttft_s is not None and o.timings.tpot_s is not None for o in outs)
        preempted = any(o.output.request.num_preemptions > 0 for o in outs)
        if preempted:
            break
    assert preempted, "no request was preempted in three tries: the test exercised nothing"


def test_async_engine_runs_on_the_pair(llm, mixed):
    async def collect(engine, prompt, rid):
        return [out async for out in engine.generate(prompt, GREEDY, rid)]

    async def main():
        engine = AsyncEngine(llm.engine)
        engine.start()
        try:
            return await asyncio.gather(*(collect(engine, p, f"a{i}") for i, p in enumerate(TIGHT)))
        finally:
            engine.shutdown()

    streams = asyncio.run(main())
    assert [s[-1].token_ids for s in streams] == [o.token_ids for o in mixed(TIGHT)]
    assert all("".join(o.delta for o in s) == s[-1].text for s in streams)


# ---- pieces, no processes -------------------------------------------------------------------
def test_records_that_overtake_the_first_token_wait_for_it():
    state = FrontendState()
    state.add("r", [1, 2], GREEDY, arrival_s=10.0)
    decode = OutputRecord("r", 1, [8, 9], [0.3, 0.4], [], "bc", False, None, None)
    prefill = OutputRecord("r", 0, [7], [0.2], [], "a", False, None, 0.1)
    state.apply("decode", WorkerUpdate(outputs=[decode]))
    assert state.live["r"].request.output_token_ids == []
    state.apply("prefill", WorkerUpdate(outputs=[prefill]))
    (out,) = state.collect()
    assert out.token_ids == [7, 8, 9] and out.text == out.delta == "abc"
    assert out.request.ttft_s == pytest.approx(0.2) and out.request.queue_s == pytest.approx(0.1)
    aborts, _ = state.apply(
        "decode",
        WorkerUpdate(outputs=[OutputRecord("gone", 3, [1], [0.5], [], "", False, None, None)]),
    )
    assert aborts == ["gone"]  # a request the front end let go of: stop it over there
    # Adopted after its abort (its K/V was on the wire): abort it at once, and only once.
    assert state.apply("decode", WorkerUpdate(adopted=["late"]))[0] == ["late"]
    late = OutputRecord("late2", 1, [2], [0.5], [], "", False, None, None)
    aborts, _ = state.apply("decode", WorkerUpdate(outputs=[late], adopted=["late2"]))
    assert aborts == ["late2"]


def test_request_meta_round_trip_shifts_foreign_clocks():
    req = Request("r", [1, 2, 3], SEEDED[0], arrival_time_s=5.0)
    req.append_output_token(4, 6.0)
    same = request_from_meta(request_meta(req), ClockStamp.now().shift_s())
    assert same.token_times_s == [6.0] and same.output_token_ids == [4]
    foreign = ClockStamp("another-host", sent_s=-100.0).shift_s()
    moved = request_from_meta(request_meta(req), foreign)
    assert moved.ttft_s == pytest.approx(1.0) and moved.arrival_time_s > 100.0


def test_worker_options_round_trip_through_the_command_line():
    opts = WorkerOptions(
        "decode",
        "small",
        "10.0.0.1:7100",
        "tcp://10.0.0.1:29500",
        threads=2,
        engine={"num_blocks": 8, "enable_prefix_caching": False, "kv_memory_fraction": 0.5,
                "kv_cache_dtype": "bfloat16", "compile": ("prefill", "decode")},
    )
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    assert options_from_args(parser.parse_args(opts.to_argv())) == opts
    with pytest.raises(UserError, match="role"):
        WorkerOptions("both", "small", "h:1", "tcp://h:2")
    with pytest.raises(UserError, match="unknown engine options"):
        DisaggConfig(model="small", engine={"policy": "mixed"})


def _nodelay(conn) -> int:
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


def test_control_connections_send_small_updates_without_nagle_delay():
    # A worker's per-step update otherwise waits for the delayed ACK of the one before.
    key = os.urandom(16)
    server = ControlServer("127.0.0.1", 0, key)
    try:
        worker_end = _connect(f"127.0.0.1:{server.address[1]}", key, 5.0)
        front_end = server.next_connection(5.0)
        assert front_end is not None
        assert _nodelay(worker_end) and _nodelay(front_end)
        worker_end.close()
        front_end.close()
    finally:
        server.close()
    a, b = Pipe()  # a Unix socket pair: nothing to set, nothing to fail
    assert without_nagle(a) is a
    a.close()
    b.close()
