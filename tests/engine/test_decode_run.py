"""Decode runs: a proved run applied at once leaves the scheduler as stepping it does."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitphase.engine.decode_run import advance_decode_run, decode_run_length
from splitphase.engine.request import Request
from splitphase.engine.sampling_params import SamplingParams
from splitphase.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

TOKEN = 1  # every step samples it, as the simulator does


def _step(s: Scheduler, now_s: float) -> tuple[SchedulerOutput, list[Request]]:
    out = s.schedule(now_s)
    sampled = {rid: [TOKEN] for rid in out.decode.request_ids}
    sampled.update({c.request_id: [TOKEN] * c.num_samples for c in out.prefill
                    if c.is_last_chunk})
    return out, s.update_from_output(out, sampled, now_s)


def _state(s: Scheduler) -> tuple[object, ...]:
    """Everything a later decision or a later prefix hit could read."""
    bm = s.block_manager
    reqs = [(r.request_id, r.status, r.num_computed_tokens, r.output_token_ids,
             r.token_times_s, r.block_table) for r in [*s.running, *s.waiting]]
    return (reqs, bm._tables, bm._ref, list(bm._free_plain), list(bm._free_cached),
            bm._hash_of, bm._block_of, bm._chains)


_request = st.tuples(st.integers(1, 24), st.integers(1, 30), st.integers(0, 12),
                     st.sampled_from([(3,), (3, 4), (5,)]))


@settings(max_examples=60, deadline=None)
@given(
    policy=st.sampled_from(["chunked", "mixed"]),
    caching=st.booleans(),
    num_blocks=st.integers(12, 40),
    seqs=st.integers(2, 5),
    requests=st.lists(_request, min_size=1, max_size=7),
)
def test_a_decode_run_equals_its_steps(policy: str, caching: bool, num_blocks: int, seqs: int,
                                       requests: list[tuple[int, int, int, tuple[int, ...]]]
                                       ) -> None:
    cfg = SchedulerConfig(policy=policy, block_size=4, num_blocks=num_blocks, max_num_seqs=seqs,
                          max_num_batched_tokens=40, enable_prefix_caching=caching,
                          max_model_len=40)
    fast, slow = Scheduler(cfg), Scheduler(cfg)
    # Prompts from a few repeated patterns: equal blocks make prefix hits and hash twins.
    pending = sorted((at, i, [p[j % len(p)] for j in range(n)], out)
                     for i, (n, out, at, p) in enumerate(requests))
    step, now_s, runs = 0, 0.0, 0
    while pending or fast.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, i, ids, out = pending.pop(0)
            for s in (fast, slow):
                s.add_request(Request(f"r{i}", ids, SamplingParams(max_tokens=out,
                                                                   ignore_eos=True)))
        until_add = pending[0][0] - step if pending else 1000
        k = decode_run_length(fast, TOKEN, until_add)
        if k:
            runs += 1
            rows = list(fast.running)
            times = [now_s + 0.5 * j for j in range(1, k + 1)]
            first = advance_decode_run(fast, rows, k, TOKEN, times)
            for t in times:
                out, finished = _step(slow, t)
                assert out.step_id == first + times.index(t)
                assert not out.prefill and not out.preempted_request_ids and not finished
                assert list(out.decode.request_ids) == [r.request_id for r in rows]
            step, now_s = step + k, times[-1]
        else:
            now_s += 0.5
            (a, a_done), (b, b_done) = _step(fast, now_s), _step(slow, now_s)
            assert a == b and [r.request_id for r in a_done] == [r.request_id for r in b_done]
            step += 1
        assert _state(fast) == _state(slow)
        fast.block_manager.check_invariants()
    assert not slow.has_unfinished_requests()


@pytest.mark.parametrize(("num_blocks", "run_steps"), [(40, 10), (6, 8)])
def test_a_run_stops_before_a_finish_or_a_preemption(num_blocks: int, run_steps: int) -> None:
    cfg = SchedulerConfig(policy="chunked", block_size=4, num_blocks=num_blocks, max_num_seqs=2,
                          max_num_batched_tokens=16, enable_prefix_caching=False)
    s = Scheduler(cfg)
    s.add_request(Request("a", [5] * 4, SamplingParams(max_tokens=12, ignore_eos=True)))
    s.add_request(Request("b", [6] * 4, SamplingParams(max_tokens=30, ignore_eos=True)))
    _step(s, 0.0)  # both prompts in one chunked step; each sampled its first token
    # a needs 11 more tokens: it finishes in the 11th step. With 6 blocks, each prompt holds
    # one; positions 4 and 8 open blocks 2 and 3 (steps 1 and 5) and take the 4 free ones, so
    # position 12 (step 9) finds none and preempts.
    k = decode_run_length(s, TOKEN, 100)
    assert k == run_steps
    advance_decode_run(s, list(s.running), k, TOKEN, [float(t) for t in range(1, k + 1)])
    out, finished = _step(s, k + 1.0)
    if num_blocks == 6:
        assert out.preempted_request_ids == ("b",) and not finished
    else:
        assert [r.request_id for r in finished] == ["a"]
    assert decode_run_length(s, TOKEN, 0) == 0
