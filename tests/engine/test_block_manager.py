"""BlockManager: allocation, prefix caching, LRU eviction, fork, and invariants under random ops."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from splitphase.engine.block_manager import (
    BlockManager,
    BlockManagerError,
    hash_block,
    slots_from_block_table,
)
from splitphase.engine.request import Request

BS = 4


def computed(bm: BlockManager, req: Request, n: int) -> None:
    """Pretend the runner computed the next n tokens of `req`."""
    req.num_computed_tokens += n
    bm.cache_computed_blocks(req)


def test_allocate_and_free_return_every_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    r = Request("a", list(range(10)))  # 3 blocks
    assert bm.can_allocate(r)
    assert bm.allocate(r) == 0
    assert len(r.block_table) == 3 and bm.num_used_blocks == 3 and bm.num_free_blocks == 5
    assert bm.usage == pytest.approx(3 / 8)
    bm.check_invariants()
    bm.free(r)
    assert r.block_table == [] and bm.num_free_blocks == 8
    bm.check_invariants()
    with pytest.raises(BlockManagerError, match="double free"):
        bm.free(r)


def test_request_table_is_a_copy() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    r = Request("a", [1, 2, 3])
    bm.allocate(r)
    r.block_table.append(3)
    assert bm.block_table("a") == (r.block_table[0],)
    bm.check_invariants()
    assert not hasattr(bm, "free_blocks")  # the free pool is not handed out


def test_out_of_blocks_and_double_allocate() -> None:
    bm = BlockManager(num_blocks=2, block_size=BS)
    big = Request("big", list(range(9)))  # 3 blocks
    assert not bm.can_allocate(big)
    with pytest.raises(BlockManagerError, match="can_allocate"):
        bm.allocate(big)
    small = Request("s", [1])
    bm.allocate(small)
    with pytest.raises(BlockManagerError, match="already"):
        bm.allocate(small)
    bm.check_invariants()


def test_prefix_cache_shares_physical_blocks() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    shared = list(range(100, 108))  # two full blocks
    a = Request("a", shared + [1, 2, 3])
    bm.allocate(a)
    computed(bm, a, a.num_tokens)
    b = Request("b", shared + [9])
    assert bm.num_cached_prefix_tokens(b) == 8
    assert bm.allocate(b) == 8
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert all(bm.ref_count(x) == 2 for x in a.block_table[:2])
    assert bm.ref_count(a.block_table[2]) == 1
    bm.check_invariants()
    # A different first block breaks the chain even if the second block matches.
    c = Request("c", [0, 0, 0, 0] + shared[4:] + [1])
    assert bm.allocate(c) == 0


def test_uncomputed_blocks_are_not_served() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = Request("a", list(range(12)))
    bm.allocate(a)
    computed(bm, a, 5)  # only block 0 is full and computed
    assert bm.allocate(Request("b", list(range(12)))) == 4


def test_whole_prompt_hit_still_recomputes_the_last_token() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    prompt = list(range(8))  # exactly two blocks
    a = Request("a", prompt)
    bm.allocate(a)
    computed(bm, a, 8)
    b = Request("b", prompt)
    assert bm.allocate(b) == 4  # the block holding the last token is fresh
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    one_block = Request("c", [0, 1, 2, 3])
    assert bm.allocate(one_block) == 0


def test_freed_cached_blocks_are_reused_then_evicted_lru() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = Request("a", list(range(8)) + [50])  # 3 blocks; blocks 0 and 1 get hashes
    bm.allocate(a)
    computed(bm, a, a.num_tokens)
    table = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    b = Request("b", list(range(8)) + [60])
    assert bm.allocate(b) == 8 and b.block_table[:2] == table[:2]  # the same physical blocks
    bm.free(b)
    # Unhashed free blocks go first; then the LRU cached one, the sequence tail (freed first).
    c = Request("c", [7] * 9)
    bm.allocate(c)
    assert bm.num_cached_blocks == 1 and table[1] in c.block_table  # block 1 was evicted
    bm.free(c)
    d = Request("d", list(range(8)) + [70])
    assert bm.allocate(d) == 4 and d.block_table[0] == table[0]
    bm.check_invariants()


def test_disabled_prefix_caching_and_reset() -> None:
    off = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = Request("a", list(range(9)))
    off.allocate(a)
    computed(off, a, 9)
    assert off.allocate(Request("b", list(range(9)))) == 0 and off.num_cached_blocks == 0

    on = BlockManager(num_blocks=8, block_size=BS)
    a = Request("a", list(range(9)))
    on.allocate(a)
    computed(on, a, 9)
    on.reset_prefix_cache()
    assert on.num_cached_blocks == 0 and on.allocate(Request("b", list(range(9)))) == 0
    on.free(a)
    on.check_invariants()


def test_append_slots_grows_on_block_boundaries() -> None:
    bm = BlockManager(num_blocks=3, block_size=BS)
    r = Request("a", [1, 2, 3])
    bm.allocate(r)
    computed(bm, r, 3)
    r.append_output_token(4, 0.0)  # position 3: still block 0
    assert bm.can_append(r, 1)
    bm.append_slots(r, 1)
    assert len(r.block_table) == 1
    computed(bm, r, 1)
    r.append_output_token(5, 0.0)  # position 4: needs block 1
    bm.append_slots(r, 1)
    assert len(r.block_table) == 2 and bm.num_cached_blocks == 1
    assert bm.can_append(r, 8) and not bm.can_append(r, 9)  # 5 + 8 tokens fit 3 blocks, + 9 not
    with pytest.raises(BlockManagerError, match="can_append"):
        bm.append_slots(r, 9)
    bm.check_invariants()


def test_try_append_slots_appends_exactly_when_can_append_holds() -> None:
    bm = BlockManager(num_blocks=3, block_size=BS)
    r = Request("a", [1, 2, 3, 4, 5])
    bm.allocate(r)
    r.num_computed_tokens = 5  # computed, hashes not yet registered
    assert not bm.try_append_slots(r, 9)  # 5 + 9 tokens need a 4th block: nothing changes
    assert len(r.block_table) == 2 and bm.num_free_blocks == 1 and bm.num_cached_blocks == 0
    assert bm.try_append_slots(r, 3)  # fits the 2 blocks held: no new block, hash registered
    assert len(r.block_table) == 2 and bm.num_free_blocks == 1 and bm.num_cached_blocks == 1
    assert bm.try_append_slots(r, 4)  # 9 positions: the third block
    assert len(r.block_table) == 3 and bm.num_free_blocks == 0
    bm.check_invariants()


def test_slot_mapping() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    bm.allocate(Request("x", [0] * 4))  # take block 0 so "a" gets others
    r = Request("a", list(range(7)))
    bm.allocate(r)
    b0, b1 = r.block_table
    assert bm.slot_mapping(r, 0, 7) == [b0 * 4, b0 * 4 + 1, b0 * 4 + 2, b0 * 4 + 3,
                                        b1 * 4, b1 * 4 + 1, b1 * 4 + 2]
    assert bm.slot_mapping("a", 5, 6) == [b1 * 4 + 1]
    assert slots_from_block_table(r.block_table, BS, 3, 5) == [b0 * 4 + 3, b1 * 4]
    with pytest.raises(BlockManagerError):
        bm.slot_mapping(r, 0, 9)


def test_fork_shares_full_blocks_and_copies_the_partial_one() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    parent = Request("p", list(range(6)))
    bm.allocate(parent)
    computed(bm, parent, 6)
    child = Request("p#1", list(range(6)), num_computed_tokens=6)
    assert bm.can_fork(parent)
    copies = bm.fork(parent, child)
    assert child.block_table[0] == parent.block_table[0]
    assert copies == [(parent.block_table[1], child.block_table[1])]
    assert bm.ref_count(parent.block_table[0]) == 2
    bm.check_invariants()
    shared = Request("p#2", list(range(6)), num_computed_tokens=6)
    assert bm.fork(parent, shared, copy_partial=False) == []
    assert shared.block_table == parent.block_table
    with pytest.raises(BlockManagerError, match="share"):
        bm.fork(parent, Request("bad", [9] * 6, num_computed_tokens=6))
    for r in (parent, child, shared):
        bm.free(r)
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_hash_chain_depends_on_parent() -> None:
    assert hash_block(b"", [1, 2]) != hash_block(hash_block(b"", [0]), [1, 2])
    assert hash_block(b"", [1, 2]) == hash_block(b"", (1, 2))


PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9], [7] * 12]


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate/compute/fork/free/preempt sequences against a fake KV memory."""

    live = Bundle("live")

    @initialize(num_blocks=st.integers(2, 20), block_size=st.integers(1, 4), caching=st.booleans())
    def setup(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.bm = BlockManager(num_blocks, block_size, caching)
        self.kv: dict[int, tuple[int, int]] = {}  # slot -> (position, token) written there
        self.requests: dict[str, Request] = {}
        self.preempted: list[Request] = []
        self.frozen: set[str] = set()  # share-all forks: read-only from then on (prefill worker)
        self.next_id = 0

    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def _check_cached_content(self, req: Request, cached: int) -> None:
        # A prefix hit is only correct if the shared slots really hold this prompt's tokens.
        slots = self.bm.slot_mapping(req, 0, cached)
        for pos, slot in enumerate(slots):
            assert self.kv.get(slot) == (pos, req.get_token_ids(pos, pos + 1)[0])

    def _admit(self, req: Request) -> Request | None:
        if not self.bm.can_allocate(req):
            with pytest.raises(BlockManagerError):
                self.bm.allocate(req)
            return None
        cached = self.bm.allocate(req)
        assert cached % self.bm.block_size == 0 and 0 <= cached < req.num_tokens
        self._check_cached_content(req, cached)
        req.num_computed_tokens = cached
        self.requests[req.request_id] = req
        return req

    @rule(target=live, prefix=st.integers(0, len(PREFIXES) - 1), cut=st.integers(0, 12),
          tail=st.lists(st.integers(0, 3), max_size=6))
    def allocate(self, prefix: int, cut: int, tail: list[int]) -> Request | None:
        tokens = PREFIXES[prefix][:cut] + tail or [0]
        return self._admit(Request(self._new_id(), tokens))

    @rule(target=live)
    @precondition(lambda self: self.preempted)
    def readmit(self) -> Request | None:
        req = self.preempted.pop()
        got = self._admit(req)
        if got is None:
            self.preempted.append(req)
        return got

    @rule(req=live, n=st.integers(1, 6), token=st.integers(0, 3))
    def compute(self, req: Request | None, n: int, token: int) -> None:
        """Compute up to n tokens (growing the table); sample a token when caught up."""
        if req is None or req.request_id not in self.requests or req.request_id in self.frozen:
            return
        k = min(n, req.num_tokens - req.num_computed_tokens)
        if not self.bm.can_append(req, k):
            with pytest.raises(BlockManagerError):
                self.bm.append_slots(req, k)
            return
        self.bm.append_slots(req, k)
        start = req.num_computed_tokens
        for pos, slot in zip(range(start, start + k), self.bm.slot_mapping(req, start, start + k),
                             strict=True):
            self.kv[slot] = (pos, req.get_token_ids(pos, pos + 1)[0])
        computed(self.bm, req, k)
        if req.num_computed_tokens == req.num_tokens:
            req.append_output_token(token, 0.0)

    @rule(target=live, req=live, copy_partial=st.booleans())
    def fork(self, req: Request | None, copy_partial: bool) -> Request | None:
        if req is None or req.request_id not in self.requests:
            return None
        child = Request(self._new_id(), req.prompt_token_ids, output_token_ids=req.output_token_ids,
                        num_computed_tokens=req.num_computed_tokens)
        if not self.bm.can_fork(req, copy_partial):
            with pytest.raises(BlockManagerError):
                self.bm.fork(req, child, copy_partial)
            return None
        copies = self.bm.fork(req, child, copy_partial)
        bs = self.bm.block_size
        for src, dst in copies:
            assert src in req.block_table and dst in child.block_table
            assert self.bm.ref_count(dst) == 1
            for off in range(bs):
                if src * bs + off in self.kv:
                    self.kv[dst * bs + off] = self.kv[src * bs + off]
        self.requests[child.request_id] = child
        if not copy_partial:
            self.frozen |= {req.request_id, child.request_id}
        self._check_cached_content(child, child.num_computed_tokens)
        return child

    @rule(req=consumes(live))
    def free(self, req: Request | None) -> None:
        if req is None or req.request_id not in self.requests:
            return
        self.bm.free(self.requests.pop(req.request_id))
        with pytest.raises(BlockManagerError):
            self.bm.free(req)

    @rule(req=consumes(live))
    def preempt(self, req: Request | None) -> None:
        if req is None or req.request_id not in self.requests:
            return
        self.bm.free(self.requests.pop(req.request_id))
        req.num_computed_tokens = 0
        self.preempted.append(req)

    @rule()
    def reset_prefix_cache(self) -> None:
        self.bm.reset_prefix_cache()

    @invariant()
    def consistent(self) -> None:
        self.bm.check_invariants()
        for rid, req in self.requests.items():
            assert tuple(req.block_table) == self.bm.block_table(rid)
            assert len(req.block_table) * self.bm.block_size >= req.num_computed_tokens
        used = {b for r in self.requests.values() for b in r.block_table}
        assert self.bm.num_used_blocks == len(used)

    def teardown(self) -> None:
        if not hasattr(self, "bm"):
            return
        for req in list(self.requests.values()):
            self.bm.free(req)
        self.bm.check_invariants()
        assert self.bm.num_free_blocks == self.bm.num_blocks  # no leak: cached-but-free is free


BlockManagerMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=30, deadline=None
)
TestBlockManagerMachine = BlockManagerMachine.TestCase


def test_block_table_snapshot_is_shared_until_the_table_changes() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    r = Request("a", [1, 2, 3, 4])
    bm.allocate(r)
    first = bm.block_table("a")
    assert first == tuple(r.block_table) and bm.block_table("a") is first  # no copy per step
    r.num_computed_tokens = 4
    bm.append_slots(r, 1)  # a fifth position: a second block
    assert bm.block_table("a") == tuple(r.block_table) and len(bm.block_table("a")) == 2
    bm.free(r)
    with pytest.raises(BlockManagerError, match="holds no blocks"):
        bm.block_table("a")
    bm.allocate(Request("a", [1]))  # the id again, a fresh table
    assert len(bm.block_table("a")) == 1
    bm.check_invariants()
