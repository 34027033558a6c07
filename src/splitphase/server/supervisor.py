"""Keeps a disaggregated pair serving: notices a dead worker, restarts the pair, reports status.

When a worker dies the pair fails every request the worker could affect (their clients get 503
`worker_unavailable`) and refuses new ones until `restart()`. This task checks the workers every
`interval_s` (idle too, so a death is noticed before the next request), and runs `restart()` on
the engine thread; while it runs, admission answers 503 at once instead of queueing behind it.
A restart that fails is retried with a doubling delay (at most `max_backoff_s`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from splitphase.engine.async_engine import AsyncEngine

log = logging.getLogger("splitphase.server")


class WorkerPair(Protocol):
    """What the supervisor needs of `DisaggregatedEngine` (called on the engine thread)."""

    def check_workers(self) -> dict[str, str]: ...

    def restart(self) -> None: ...

    @property
    def worker_pids(self) -> dict[str, int]: ...

    @property
    def dead_workers(self) -> dict[str, str]: ...


class WorkerSupervisor:
    """A background task on the server's event loop; `status()` feeds /health."""

    def __init__(self, engine: AsyncEngine, pair: WorkerPair, interval_s: float = 0.25,
                 max_backoff_s: float = 30.0, check_timeout_s: float = 10.0) -> None:
        self.engine, self.pair = engine, pair
        self.interval_s, self.max_backoff_s = interval_s, max_backoff_s
        self.check_timeout_s = check_timeout_s
        self.restarts = 0
        self.restarting = False
        self.dead: dict[str, str] = {}
        self.pids: dict[str, int] = dict(pair.worker_pids)
        self.last_error: str | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start checking (call on the server's event loop)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        """Stop checking."""
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def _dead_now(self) -> dict[str, str]:
        """Dead workers as last checked, plus any the engine thread noticed since."""
        try:  # read across threads: the engine thread may be changing the dict right now
            return {**self.dead, **self.pair.dead_workers}
        except RuntimeError:
            return dict(self.dead)

    @property
    def serving(self) -> bool:
        """False while a worker is dead or the pair is being restarted."""
        return not self.restarting and not self._dead_now()

    def status(self) -> dict[str, Any]:
        """Each worker's pid and state, the restarts so far, the last restart failure."""
        workers: dict[str, Any] = {}
        dead = self._dead_now()
        for role, pid in self.pids.items():
            state = "restarting" if self.restarting else "ok"
            if role in dead and not self.restarting:
                state = f"dead: {dead[role]}"
            workers[role] = {"pid": pid, "status": state}
        return {"workers": workers, "worker_restarts": self.restarts,
                "worker_restart_error": self.last_error}

    async def _run(self) -> None:
        delay_s = self.interval_s
        while True:
            await asyncio.sleep(delay_s)
            if not self.engine.is_running:
                continue  # /health reports the loop itself
            try:
                self.dead = await asyncio.wait_for(self.engine.call(self.pair.check_workers),
                                                   self.check_timeout_s)
            except asyncio.TimeoutError:
                continue  # a long step; /health's stall check covers a stuck loop
            except Exception as exc:
                if self.engine.is_running:  # else the server is shutting down: nothing failed
                    log.warning("worker check failed: %r", exc)
                continue
            if not self.dead or await self.restart():
                delay_s = self.interval_s
            else:
                delay_s = min(self.max_backoff_s, max(delay_s, self.interval_s) * 2)

    async def restart(self) -> bool:
        """Restart the pair on the engine thread; True when both workers are back."""
        self.restarting = True
        log.warning("restarting the worker pair: %s", "; ".join(
            f"the {role} worker {why}" for role, why in self.dead.items()))
        try:
            await self.engine.call(self.pair.restart)
        except Exception as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.error("worker restart failed (retrying): %s", self.last_error)
            return False
        finally:
            self.restarting = False
        self.restarts += 1
        self.dead, self.last_error = {}, None
        self.pids = dict(self.pair.worker_pids)
        log.info("worker pair restarted (pids %s)", self.pids)
        return True
