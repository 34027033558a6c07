"""A simulated deployment: pools of replicas (colocated, or prefill + decode) and a router."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from operator import attrgetter

from splitphase.engine.scheduler import SchedulerConfig
from splitphase.errors import UserError
from splitphase.hardware.specs import LinkSpec, get_link
from splitphase.sim.cost_model import CostModel, Efficiency
from splitphase.sim.replica import Replica

ROUTERS = ("round_robin", "least_loaded")
_outstanding = attrgetter("outstanding")


@dataclass(frozen=True)
class PoolConfig:
    """`replicas` identical replicas, each `tp` devices, scheduling with `scheduler`."""

    replicas: int
    tp: int
    scheduler: SchedulerConfig
    efficiency: Efficiency = field(default_factory=Efficiency)

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.tp < 1:
            raise UserError(f"a pool needs >= 1 replica of >= 1 device, got {self}")

    @property
    def num_gpus(self) -> int:
        return self.replicas * self.tp

    def label(self) -> str:
        s = self.scheduler
        return (f"{self.replicas}x tp{self.tp} (budget {s.max_num_batched_tokens},"
                f" seqs {s.max_num_seqs})")


@dataclass(frozen=True)
class ClusterConfig:
    """Colocated (`colocated` pool) or disaggregated (`prefill` and `decode` pools)."""

    colocated: PoolConfig | None = None
    prefill: PoolConfig | None = None
    decode: PoolConfig | None = None
    router: str = "least_loaded"
    link: LinkSpec = field(default_factory=lambda: get_link("nvlink"))
    dispatch_s: float = 0.0  # front-end hop: arrival to the request queued at its replica

    def __post_init__(self) -> None:
        if not self.dispatch_s >= 0:
            raise UserError(f"dispatch_s must be >= 0 seconds, got {self.dispatch_s}")
        if (self.colocated is None) == (self.prefill is None or self.decode is None):
            raise UserError("a cluster is either colocated or has both a prefill and a decode pool")
        if self.router not in ROUTERS:
            raise UserError(f"router must be one of {ROUTERS}, got {self.router!r}")
        if self.colocated is not None and self.colocated.scheduler.role is not None:
            raise UserError("a colocated pool runs policy mixed or chunked (no role)")
        for pool, role in ((self.prefill, "prefill"), (self.decode, "decode")):
            if pool is not None and pool.scheduler.role != role:
                raise UserError(f"the {role} pool needs a scheduler with role={role!r}")

    @property
    def policy(self) -> str:
        return "disaggregated" if self.colocated is None else self.colocated.scheduler.policy

    @property
    def num_gpus(self) -> int:
        return sum(p.num_gpus for p in self.pools())

    def pools(self) -> list[PoolConfig]:
        return [p for p in (self.colocated, self.prefill, self.decode) if p is not None]

    def label(self) -> str:
        """A short human-readable name."""
        if self.colocated is not None:
            return f"{self.policy} {self.colocated.label()}"
        assert self.prefill is not None and self.decode is not None
        return f"disaggregated P {self.prefill.label()} + D {self.decode.label()}"

    def scaled(self, factor: int) -> ClusterConfig:
        """The same unit replicated `factor` times (every pool's replica count multiplied)."""
        def mul(p: PoolConfig | None) -> PoolConfig | None:
            return None if p is None else replace(p, replicas=p.replicas * factor)
        return replace(self, colocated=mul(self.colocated), prefill=mul(self.prefill),
                       decode=mul(self.decode))


class Router:
    """Picks a replica for each request: round-robin, or the one with the fewest outstanding."""

    def __init__(self, kind: str, replicas: list[Replica]) -> None:
        self.kind, self.replicas, self._next = kind, replicas, 0

    def pick(self) -> Replica:
        if self.kind == "round_robin" or len(self.replicas) == 1:
            r = self.replicas[self._next % len(self.replicas)]
            self._next += 1
            return r
        return min(self.replicas, key=_outstanding)  # the first of equals, as before


def build_pool(name: str, pool: PoolConfig, cost: CostModel, record_steps: bool = False,
               fast_forward: bool = True) -> list[Replica]:
    """The replicas of one pool (each with its own scheduler and the pool's cost model)."""
    c = replace(cost, tp=pool.tp, efficiency=pool.efficiency)
    return [Replica(f"{name}{i}", pool.scheduler, c, record_steps, fast_forward)
            for i in range(pool.replicas)]
