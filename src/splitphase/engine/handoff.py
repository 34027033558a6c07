"""Disaggregated handoffs: requests leaving one worker's scheduler for the other (no torch).

A prefill worker hands a request on once its first token is sampled; its blocks stay allocated
here (the KV must still be copied out) until the driver calls `release`. A decode worker hands
back the requests it preempted: they own no blocks here and need a fresh prefill over there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from splitphase.engine.block_manager import BlockManager
from splitphase.engine.request import Request
from splitphase.engine.scheduler_config import SchedulerError


@dataclass(frozen=True)
class Handoff:
    """A request leaving this scheduler for the other worker.

    From a prefill worker: `block_table` holds its computed KV (num_computed_tokens positions)
    until `release_handoff`. From a decode worker (preempted): empty, it needs a fresh prefill.
    """

    request: Request
    block_table: tuple[int, ...]
    num_computed_tokens: int


class HandoffBook:
    """The requests ready to leave, and the popped ones whose blocks are still held here."""

    def __init__(self, block_manager: BlockManager) -> None:
        self.block_manager = block_manager
        self.ready: list[Request] = []
        self.held: set[str] = set()  # prefill role: popped, blocks still held

    def is_held(self, request_id: str) -> bool:
        """True if a popped handoff with this id still holds blocks here."""
        return request_id in self.held

    def pop(self, forget: Callable[[str], None]) -> list[Handoff]:
        """The ready requests as handoffs; `forget` drops each from the scheduler's books."""
        out = []
        bm = self.block_manager
        for req in self.ready:
            rid = req.request_id
            forget(rid)
            table: tuple[int, ...] = ()
            if bm.has_blocks(rid):
                table = bm.block_table(rid)
                self.held.add(rid)
            out.append(Handoff(req, table, req.num_computed_tokens))
        self.ready.clear()
        return out

    def release(self, request_id: str) -> None:
        """Free a popped handoff's blocks once its KV has been copied out."""
        if request_id not in self.held:
            raise SchedulerError(f"{request_id!r} is not a popped handoff holding blocks here")
        self.held.remove(request_id)
        self.block_manager.free(request_id)
