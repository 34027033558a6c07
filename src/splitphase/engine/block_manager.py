"""Paged KV-cache bookkeeping: a pool of fixed-size blocks, refcounts, prefix caching (no torch).

Physical slot of token position p in a request = block_table[p // block_size] * block_size
+ p % block_size. Prefix caching follows vLLM v1: a FULL block whose tokens are all computed is
keyed by a hash chain h_i = H(h_{i-1}, tokens of block i); when its last user frees it, it goes
to the free pool but keeps its hash, so a later prompt with the same prefix reuses it until the
pool needs the block back (LRU eviction). Free blocks that carry no hash are handed out first,
so cached ones live as long as possible.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence

from splitphase.engine.request import Request

BlockHash = bytes
_ROOT_HASH: BlockHash = b""


class BlockManagerError(RuntimeError):
    """A block-manager call that breaks its contract (out of blocks, double free, unknown id)."""


def hash_block(parent_hash: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Content hash of one full block given its parent's hash (sha256, as vLLM uses by default)."""
    # A cryptographic hash rather than Python's hash(): a collision would silently serve another
    # prompt's KV (vLLM moved to sha256 for this reason).
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()


def slots_from_block_table(
    block_table: Sequence[int], block_size: int, start: int, end: int
) -> list[int]:
    """Physical slots of token positions [start, end) under `block_table`."""
    if not 0 <= start <= end <= len(block_table) * block_size:
        raise BlockManagerError(
            f"positions [{start}, {end}) outside the {len(block_table)}-block table"
            f" ({len(block_table) * block_size} slots)"
        )
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Allocates KV blocks to requests, shares them by refcount and caches full prefix blocks."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise BlockManagerError(
                f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._free_plain: deque[int] = deque(range(num_blocks))  # free, no hash
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # free with hash, LRU first
        self._hash_of: dict[int, BlockHash] = {}  # block id -> hash, for cached blocks
        self._block_of: dict[BlockHash, int] = {}  # hash -> block id
        self._tables: dict[str, list[int]] = {}
        # Tuple copies of tables handed out by block_table(), dropped whenever a table changes:
        # every step snapshots every scheduled request's table, and most tables did not change.
        self._snapshots: dict[str, tuple[int, ...]] = {}
        # Hash chain of each request's computed full blocks (the parent of its next block).
        self._chains: dict[str, list[BlockHash]] = {}

    # ---- pool state ---------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (cached-but-unreferenced ones count as free)."""
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one request."""
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the pool in use, 0..1."""
        return self.num_used_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that carry a prefix hash (in use or free)."""
        return len(self._block_of)

    def ref_count(self, block_id: int) -> int:
        """How many block tables hold `block_id`."""
        return self._ref[block_id]

    def has_blocks(self, request_id: str) -> bool:
        """True if this manager holds a block table for `request_id`."""
        return request_id in self._tables

    def block_table(self, request_id: str) -> tuple[int, ...]:
        """A copy of the request's block table (immutable, so shared until the table changes)."""
        snapshot = self._snapshots.get(request_id)
        if snapshot is None:
            snapshot = self._snapshots[request_id] = tuple(self._table(request_id))
        return snapshot

    def block_tables(self, request_ids: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """`block_table` of each id, in order (one call per step for a whole decode batch)."""
        tables = tuple(map(self._snapshots.get, request_ids))
        if None not in tables:  # a table is never empty, so None only marks a missing snapshot
            return tables  # type: ignore[return-value]
        return tuple([self.block_table(rid) for rid in request_ids])

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` token positions."""
        return _cdiv(num_tokens, self.block_size)

    # ---- allocation ---------------------------------------------------------------------
    def num_cached_prefix_tokens(self, request: Request) -> int:
        """Prompt tokens `allocate` would find already computed (no side effects)."""
        return len(self._probe(request)) * self.block_size

    def can_allocate(self, request: Request) -> bool:
        """True if `allocate(request)` would succeed now."""
        return self._num_free_needed(request, self._probe(request)) <= self.num_free_blocks

    def allocate(self, request: Request) -> int:
        """Give the request blocks for all its tokens, reusing cached prefix blocks.

        Returns the number of leading tokens whose KV is already cached. It is a multiple of
        block_size and always < request.num_tokens: the last token is recomputed so the step has
        logits to sample from (vLLM v1 caps hits at num_tokens - 1 the same way), which also
        means a step never writes into a shared block.
        """
        rid = request.request_id
        if rid in self._tables:
            raise BlockManagerError(f"request {rid!r} already has blocks; free it first")
        hits = self._probe(request)
        if self._num_free_needed(request, hits) > self.num_free_blocks:
            raise BlockManagerError(
                f"cannot allocate {self.blocks_needed(request.num_tokens)} blocks for {rid!r}:"
                f" {self.num_free_blocks} free; check can_allocate() first"
            )
        table = []
        for block_id, _ in hits:  # take hits first so fresh allocation cannot evict them
            if self._ref[block_id] == 0:
                del self._free_cached[block_id]
            self._ref[block_id] += 1
            table.append(block_id)
        for _ in range(self.blocks_needed(request.num_tokens) - len(hits)):
            table.append(self._pop_free())
        self._tables[rid] = table
        self._snapshots.pop(rid, None)
        if self.enable_prefix_caching:
            self._chains[rid] = [h for _, h in hits]
        request.block_table = list(table)
        return len(hits) * self.block_size

    def can_append(self, request: Request, num_new_tokens: int) -> bool:
        """True if the table can grow to hold num_computed_tokens + num_new_tokens positions."""
        # Called for every decoding request every step: the pool size is read inline.
        need = self._num_to_append(request, num_new_tokens)
        return need <= 0 or need <= len(self._free_plain) + len(self._free_cached)

    def append_slots(self, request: Request, num_new_tokens: int) -> None:
        """Grow the table to hold num_computed_tokens + num_new_tokens positions.

        Also registers the prefix hashes of blocks that became full and computed.
        """
        if not self.try_append_slots(request, num_new_tokens):
            raise BlockManagerError(
                f"cannot append {self._num_to_append(request, num_new_tokens)} blocks for"
                f" {request.request_id!r}: {self.num_free_blocks} free; check can_append() first"
            )

    def try_append_slots(self, request: Request, num_new_tokens: int) -> bool:
        """`append_slots` if `can_append` holds (True), else change nothing (False)."""
        # One check instead of can_append's and append_slots' two: it runs per decode per step.
        need = self._num_to_append(request, num_new_tokens)
        if need > 0 and need > len(self._free_plain) + len(self._free_cached):
            return False
        if self.enable_prefix_caching:
            self.cache_computed_blocks(request)
        if need > 0:  # else the common decode step: the last block still has a free slot
            table = self._tables[request.request_id]
            table.extend(self._pop_free() for _ in range(need))
            self._snapshots.pop(request.request_id, None)
            request.block_table = list(table)
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Register hashes of the request's full blocks whose tokens are all computed."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        table, chain = self._table(rid), self._chains[rid]
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        bs = self.block_size
        for i in range(len(chain), num_full):
            parent = chain[-1] if chain else _ROOT_HASH
            h = hash_block(parent, request.get_token_ids(i * bs, (i + 1) * bs))
            chain.append(h)
            block_id = table[i]
            # A twin computed in the same step keeps the first registration; this copy stays
            # unhashed and returns to the plain free pool when freed (vLLM does the same).
            if block_id not in self._hash_of and h not in self._block_of:
                self._hash_of[block_id] = h
                self._block_of[h] = block_id

    def free(self, request: Request | str) -> None:
        """Drop the request's table; blocks whose refcount reaches 0 return to the free pool.

        Takes the request or, for one whose object has moved on (handed to a decode worker),
        its id; only a Request argument has its `block_table` cleared.
        """
        rid = request if isinstance(request, str) else request.request_id
        table = self._tables.pop(rid, None)
        self._snapshots.pop(rid, None)
        if table is None:
            raise BlockManagerError(f"request {rid!r} holds no blocks (double free?)")
        self._chains.pop(rid, None)
        # Reverse order: the tail of a sequence is the least likely to be shared, so it becomes
        # the least recently used and is evicted first (vLLM v1 free order).
        for block_id in reversed(table):
            self._ref[block_id] -= 1
            if self._ref[block_id] == 0:
                if block_id in self._hash_of:
                    self._free_cached[block_id] = None
                else:
                    self._free_plain.append(block_id)
        if isinstance(request, Request):
            request.block_table = []

    def can_fork(self, parent: Request, copy_partial: bool = True) -> bool:
        """True if `fork(parent, ..., copy_partial)` would succeed now."""
        return self._num_fork_blocks(parent, copy_partial) <= self.num_free_blocks

    def fork(
        self, parent: Request, child: Request, copy_partial: bool = True
    ) -> list[tuple[int, int]]:
        """Give `child` (same tokens, same num_computed_tokens) the parent's KV.

        Fully computed blocks are shared by refcount. With copy_partial, every other parent block
        gets a fresh block for the child, and the returned (src, dst) pairs name the blocks whose
        computed slots must be copied before the next forward pass (vLLM v0 copy-on-write).
        Without it (a prefill worker whose blocks are only read from now on) all blocks are shared.
        """
        pid, cid = parent.request_id, child.request_id
        if cid in self._tables:
            raise BlockManagerError(f"request {cid!r} already has blocks")
        n = parent.num_computed_tokens
        same = child.num_computed_tokens == n
        if not same or child.get_token_ids(0, n) != parent.get_token_ids(0, n):
            raise BlockManagerError(f"fork: {cid!r} must share the {n} computed tokens of {pid!r}")
        if not self.can_fork(parent, copy_partial):
            raise BlockManagerError(f"fork of {pid!r}: out of blocks; check can_fork() first")
        ptable = self._table(pid)
        num_shared = len(ptable) if not copy_partial else min(n // self.block_size, len(ptable))
        table, copies = list(ptable[:num_shared]), []
        for block_id in table:
            self._ref[block_id] += 1
        for i in range(num_shared, len(ptable)):
            dst = self._pop_free()
            table.append(dst)
            if i * self.block_size < n:  # the block holds computed slots to carry over
                copies.append((ptable[i], dst))
        self._tables[cid] = table
        self._snapshots.pop(cid, None)
        if self.enable_prefix_caching:
            self._chains[cid] = self._chains[pid][: min(num_shared, n // self.block_size)]
        child.block_table = list(table)
        return copies

    def slot_mapping(self, request: Request | str, start: int, end: int) -> list[int]:
        """Physical slots (block_id * block_size + offset) of positions [start, end)."""
        rid = request if isinstance(request, str) else request.request_id
        return slots_from_block_table(self._table(rid), self.block_size, start, end)

    def reset_prefix_cache(self) -> None:
        """Forget every prefix hash (e.g. after new weights); tables and refcounts are untouched."""
        self._free_plain.extend(self._free_cached)
        self._free_cached.clear()
        self._hash_of.clear()
        self._block_of.clear()
        self._chains = {rid: [] for rid in self._chains}

    # ---- internals ----------------------------------------------------------------------
    def _table(self, request_id: str) -> list[int]:
        try:
            return self._tables[request_id]
        except KeyError:
            raise BlockManagerError(f"request {request_id!r} holds no blocks") from None

    def _probe(self, request: Request) -> list[tuple[int, BlockHash]]:
        """Cached blocks matching the leading full blocks of the first num_tokens - 1 tokens."""
        if not self.enable_prefix_caching or not request.use_prefix_cache:
            return []
        hits: list[tuple[int, BlockHash]] = []
        parent, bs = _ROOT_HASH, self.block_size
        for i in range((request.num_tokens - 1) // bs):
            h = hash_block(parent, request.get_token_ids(i * bs, (i + 1) * bs))
            block_id = self._block_of.get(h)
            if block_id is None:
                break
            hits.append((block_id, h))
            parent = h
        return hits

    def _num_free_needed(self, request: Request, hits: list[tuple[int, BlockHash]]) -> int:
        # Hits nobody references still leave the free pool when taken; referenced hits do not.
        referenced = sum(1 for block_id, _ in hits if self._ref[block_id] > 0)
        return self.blocks_needed(request.num_tokens) - referenced

    def _num_to_append(self, request: Request, num_new_tokens: int) -> int:
        """Blocks the table lacks for the new tokens (<= 0: it has room already)."""
        if num_new_tokens < 0:
            raise BlockManagerError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        table = self._tables.get(request.request_id)
        if table is None:
            raise BlockManagerError(f"request {request.request_id!r} holds no blocks")
        # -(-a // b): ceil(a / b) in integers, as blocks_needed computes it (inlined: hot path).
        return -(-(request.num_computed_tokens + num_new_tokens) // self.block_size) - len(table)

    def _num_fork_blocks(self, parent: Request, copy_partial: bool) -> int:
        table = self._table(parent.request_id)
        if not copy_partial:
            return 0
        return len(table) - min(parent.num_computed_tokens // self.block_size, len(table))

    def _pop_free(self) -> int:
        """Take a free block for one table (refcount 1), evicting the LRU cached one if needed."""
        if self._free_plain:
            block_id = self._free_plain.popleft()
        elif self._free_cached:
            block_id, _ = self._free_cached.popitem(last=False)
            del self._block_of[self._hash_of.pop(block_id)]
        else:
            raise BlockManagerError("no free KV blocks")
        self._ref[block_id] = 1
        return block_id

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent (used by tests)."""
        counts = [0] * self.num_blocks
        for rid, table in self._tables.items():
            if len(set(table)) != len(table):
                raise AssertionError(f"{rid!r}: a block appears twice in its table {table}")
            for block_id in table:
                counts[block_id] += 1
        if counts != self._ref:
            raise AssertionError("refcounts differ from the number of tables holding each block")
        plain, cached = set(self._free_plain), set(self._free_cached)
        if len(plain) != len(self._free_plain) or plain & cached:
            raise AssertionError("a block is free twice")
        free = plain | cached
        for block_id in range(self.num_blocks):
            if (block_id in free) != (self._ref[block_id] == 0):
                raise AssertionError(f"block {block_id} is neither free nor referenced, or both")
        if len(free) + sum(1 for r in self._ref if r > 0) != self.num_blocks:
            raise AssertionError("free + used != num_blocks")
        if any(self._block_of.get(h) != b for b, h in self._hash_of.items()) or len(
            self._block_of
        ) != len(self._hash_of):
            raise AssertionError("hash maps disagree")
        if any(b not in self._hash_of for b in cached) or any(b in self._hash_of for b in plain):
            raise AssertionError("a free block sits in the wrong pool for its hash state")
