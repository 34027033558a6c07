"""Fixtures: one torch thread, and `splitphase serve` on the tiny checkpoint (tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from splitphase.server.process import ServerProcess


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread(one_torch_thread: None) -> None:
    """Every server test runs with torch on one thread (tests/conftest.py)."""


# The engine on a thread of the server, or in its own process: every route behaves the same.
ENGINE_MODES = ["--no-engine-process", "--engine-process"]


@pytest.fixture(scope="module", params=ENGINE_MODES, ids=["engine-thread", "engine-process"])
def server(tiny_ckpt: Path, launch: Callable[..., ServerProcess],
           request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    proc = launch(tiny_ckpt, "--max-num-seqs", "32", request.param)
    yield proc
    assert proc.stop() == 0, proc.log()
