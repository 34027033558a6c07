"""Property tests: a hypothesis state machine drives the Scheduler (and its BlockManager) with
random arrivals, steps, aborts at any moment (also between schedule and update) and failed
steps; after every rule the bookkeeping must hold, and at the end every request is terminal
and every block free. (The BlockManager's own machine is in tests/engine.)"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from splitphase.engine.request import Request, RequestStatus
from splitphase.engine.sampling_params import SamplingParams
from splitphase.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from splitphase.reliability.ledger import Ledger

VOCAB, EOS = 24, 0
MAX_MODEL_LEN = 40
DRAIN_STEPS = 2000
TALLY = {"examples": 0, "rules": 0, "requests": 0, "aborts": 0, "failed_steps": 0}


def _token(context: Sequence[int], k: int) -> int:
    """A deterministic 'greedy' token of the whole context (sample k of n)."""
    h = 7
    for t in context:
        h = (h * 31 + t + 1) % 1_000_003
    return (h + 5 * k) % VOCAB


class SchedulerMachine(RuleBasedStateMachine):
    """Random traffic against one Scheduler; `self.requests` remembers every request made."""

    def __init__(self) -> None:
        super().__init__()
        TALLY["examples"] += 1
        self.sched: Scheduler | None = None
        self.requests: dict[str, Request] = {}
        self.next_id = 0
        self.clock_s = 0.0

    @initialize(policy=st.sampled_from(["mixed", "chunked"]), num_blocks=st.integers(10, 24),
                max_num_seqs=st.integers(1, 5), caching=st.booleans())
    def configure(self, policy: str, num_blocks: int, max_num_seqs: int, caching: bool) -> None:
        self.sched = Scheduler(SchedulerConfig(
            policy=policy, max_num_seqs=max_num_seqs, max_num_batched_tokens=MAX_MODEL_LEN,
            block_size=4, num_blocks=num_blocks, max_model_len=MAX_MODEL_LEN, eos_token_id=EOS,
            enable_prefix_caching=caching))

    @rule(prompt=st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=20),
          shared=st.booleans(), max_tokens=st.integers(1, 12), n=st.sampled_from([1, 1, 2, 3]),
          ignore_eos=st.booleans())
    def add(self, prompt: list[int], shared: bool, max_tokens: int, n: int,
            ignore_eos: bool) -> None:
        assert self.sched is not None
        if shared:  # a common prefix exercises the prefix cache
            prompt = [1, 2, 3, 4, 5, 6, 7, 8, *prompt][:20]
        self.next_id += 1
        req = Request(f"r{self.next_id}", prompt,
                      SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=ignore_eos),
                      arrival_time_s=self.clock_s)
        self.sched.add_request(req)
        self.requests[req.request_id] = req
        TALLY["requests"] += 1

    def _schedule(self) -> SchedulerOutput:
        assert self.sched is not None
        self.clock_s += 1.0
        out = self.sched.schedule(self.clock_s)
        cfg = self.sched.config
        ids = [c.request_id for c in out.prefill] + [d.request_id for d in out.decode]
        assert len(ids) == len(set(ids)) and out.num_seqs <= cfg.max_num_seqs
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        return out

    def _sampled(self, out: SchedulerOutput) -> dict[str, list[int]]:
        assert self.sched is not None
        sampled: dict[str, list[int]] = {}
        for c in out.prefill:
            req = self.sched.get_request(c.request_id)
            if req is not None and c.num_samples:
                ctx = req.all_token_ids[: c.end]
                sampled[c.request_id] = [_token(ctx, k) for k in range(c.num_samples)]
        for d in out.decode:
            req = self.sched.get_request(d.request_id)
            if req is not None:
                sampled[d.request_id] = [_token(req.all_token_ids, 0)]
        return sampled

    def _update(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> None:
        assert self.sched is not None
        for req in self.sched.update_from_output(out, sampled, self.clock_s + 0.5):
            assert req.is_finished and not self.sched.block_manager.has_blocks(req.request_id)
        self._adopt_children()

    def _adopt_children(self) -> None:
        for req in list(self.requests.values()):
            for child in req.children:
                self.requests.setdefault(child.request_id, child)

    @rule()
    def step(self) -> None:
        out = self._schedule()
        self._update(out, self._sampled(out))

    @rule(pick=st.integers(0, 10_000), mid_step=st.booleans())
    @precondition(lambda self: self.requests)
    def abort(self, pick: int, mid_step: bool) -> None:
        """Abort any request (finished ones too: no double free), maybe between schedule and
        update, as a client disconnect lands on the engine thread."""
        assert self.sched is not None
        out = self._schedule() if mid_step else None
        sampled = self._sampled(out) if out is not None else {}
        rid = sorted(self.requests)[pick % len(self.requests)]
        was_live = self.sched.get_request(rid) is not None
        free_before = self.sched.block_manager.num_free_blocks
        got = self.sched.abort_request(rid, self.clock_s)
        assert (got is not None) == was_live
        if not was_live:
            assert self.sched.block_manager.num_free_blocks == free_before
        else:
            assert got is not None and got.status is RequestStatus.FINISHED_ABORTED
            TALLY["aborts"] += 1
        if out is not None:
            self._update(out, sampled)

    @rule()
    @precondition(lambda self: self.sched.has_unfinished_requests())
    def failed_step(self) -> None:
        """A forward that raises: every request in the step ends with an error (LLMEngine)."""
        assert self.sched is not None
        out = self._schedule()
        for rid in [c.request_id for c in out.prefill] + [d.request_id for d in out.decode]:
            self.sched.abort_request(rid, self.clock_s, RequestStatus.FINISHED_ERROR)
        self._update(out, {})
        TALLY["failed_steps"] += 1

    @invariant()
    def bookkeeping_holds(self) -> None:
        TALLY["rules"] += 1
        if self.sched is None:
            return
        bm = self.sched.block_manager
        bm.check_invariants()  # ref counts = tables holding each block; nothing free twice
        running = {r.request_id for r in self.sched.running}
        waiting = {r.request_id for r in self.sched.waiting}
        assert not running & waiting
        for rid, req in self.requests.items():
            live = self.sched.get_request(rid) is not None
            assert live != req.is_finished, (rid, req.status)
            if not live:
                assert not bm.has_blocks(rid), f"finished {rid} still holds blocks"
        for rid in waiting:
            assert not bm.has_blocks(rid), f"waiting {rid} holds blocks"

    def teardown(self) -> None:
        if self.sched is None:
            return
        for _ in range(DRAIN_STEPS):
            if not self.sched.has_unfinished_requests():
                break
            self.step()
        self._adopt_children()
        assert not self.sched.has_unfinished_requests(), "requests never finished"
        assert all(r.is_finished for r in self.requests.values())
        assert self.sched.block_manager.num_free_blocks == self.sched.block_manager.num_blocks


SchedulerMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=50,
                                              deadline=None)
TestScheduler = SchedulerMachine.TestCase


def test_record_the_property_runs(ledger: Ledger) -> None:
    """Runs after the machine (file order): the ledger gets what it exercised."""
    if TALLY["examples"] == 0:
        SchedulerMachine.TestCase().runTest()
    assert TALLY["requests"] > 0 and TALLY["aborts"] > 0 and TALLY["failed_steps"] > 0
    ledger.record("properties", "Scheduler state machine (hypothesis)",
                  f"{TALLY['examples']} random runs, {TALLY['rules']:,} rules: "
                  f"{TALLY['requests']:,} requests, {TALLY['aborts']:,} aborts (some between "
                  f"schedule and update), {TALLY['failed_steps']:,} failed steps; after every "
                  "rule: ref counts consistent, nothing freed twice, finished requests hold "
                  "no blocks; at the end every request terminal and every block free",
                  faults=TALLY["aborts"] + TALLY["failed_steps"])
