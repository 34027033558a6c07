"""WorkerSupervisor: a dead worker is noticed while idle, the pair restarted, failures retried."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import pytest

from splitphase.engine.async_engine import AsyncEngine, EngineDeadError
from splitphase.server.supervisor import WorkerSupervisor


class FakePair:
    """An idle engine whose workers die on command; `restart` fails `failures` times first."""

    def __init__(self, failures: int = 0) -> None:
        self.dead: dict[str, str] = {}  # what has happened
        self.noticed: dict[str, str] = {}  # what the engine thread knows (dead_workers)
        self.failures, self.restarts, self.generation = failures, 0, 0

    @property
    def worker_pids(self) -> dict[str, int]:
        return {"prefill": 100 + self.generation, "decode": 200 + self.generation}

    @property
    def dead_workers(self) -> dict[str, str]:
        return dict(self.noticed)

    def check_workers(self) -> dict[str, str]:
        self.noticed = dict(self.dead)
        return self.noticed

    def restart(self) -> None:
        if self.failures:
            self.failures -= 1
            raise RuntimeError("the new pair did not dial in")
        self.restarts += 1
        self.generation += 1
        self.dead, self.noticed = {}, {}

    def add_request(self, *args: object, **kwargs: object) -> str:
        raise AssertionError("not used")

    def step(self) -> list:
        return []

    def abort_request(self, *args: object, **kwargs: object) -> None:
        pass

    def has_unfinished_requests(self) -> bool:
        return False


async def _until(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond() and loop.time() < deadline:
        await asyncio.sleep(0.01)


def _run(pair: FakePair, check: Callable[[WorkerSupervisor], Awaitable[None]]) -> None:
    engine = AsyncEngine(pair)  # type: ignore[arg-type]
    engine.start()

    async def main() -> None:
        sup = WorkerSupervisor(engine, pair, interval_s=0.02, max_backoff_s=0.1)
        sup.start()
        try:
            await check(sup)
        finally:
            sup.stop()

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_a_dead_worker_is_restarted_while_idle() -> None:
    pair = FakePair()

    async def check(sup: WorkerSupervisor) -> None:
        assert sup.serving and sup.status()["workers"]["decode"] == {"pid": 200, "status": "ok"}
        pair.dead = {"decode": "exited with signal SIGKILL"}
        await _until(lambda: pair.restarts == 1 and sup.serving)
        status = sup.status()
        assert status["worker_restarts"] == 1 and status["worker_restart_error"] is None
        assert status["workers"]["decode"] == {"pid": 201, "status": "ok"}

    _run(pair, check)


def test_a_failed_restart_is_reported_and_retried() -> None:
    pair = FakePair(failures=2)

    async def check(sup: WorkerSupervisor) -> None:
        pair.dead = {"prefill": "failed: out of memory"}
        await _until(lambda: sup.last_error is not None)
        assert not sup.serving and "did not dial in" in sup.status()["worker_restart_error"]
        assert sup.status()["workers"]["prefill"]["status"].startswith(("dead", "restarting"))
        await _until(lambda: pair.restarts == 1 and sup.serving)
        assert sup.restarts == 1 and sup.last_error is None

    _run(pair, check)


class _CheckFailsEngine:
    """An engine whose every call fails; `stops` says whether its loop ends with the call, as
    when the server shuts down while a check is in flight."""

    def __init__(self, stops: bool) -> None:
        self.is_running, self.stops = True, stops

    async def call(self, fn: Callable[[], object]) -> object:
        self.is_running = not self.stops
        raise EngineDeadError("the engine loop is not running")


@pytest.mark.parametrize("stops", [False, True])
def test_a_check_cut_short_by_shutdown_is_not_reported_as_a_failure(
    stops: bool, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        sup = WorkerSupervisor(_CheckFailsEngine(stops), FakePair(),  # type: ignore[arg-type]
                               interval_s=0.01)
        sup.start()
        await asyncio.sleep(0.1)
        sup.stop()

    with caplog.at_level(logging.WARNING, logger="splitphase.server"):
        asyncio.run(main())
    assert ("worker check failed" in caplog.text) is not stops
