"""Fixtures of the reliability suite: in-process servers and the ledger of figures.

`tiny_ckpt` and `launch` (a `splitphase serve` child) come from tests/conftest.py.

Set SPLITPHASE_RELIABILITY_OUT=path.json to keep the ledger (tools/reliability_report.py does,
then renders the README section from it).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from splitphase.engine.llm import LLM
from splitphase.reliability.inproc import InProcessServer
from splitphase.reliability.ledger import Ledger
from splitphase.server.app import create_app
from splitphase.server.config import ServerConfig
from splitphase.server.state import ServerState

OUT_ENV = "SPLITPHASE_RELIABILITY_OUT"


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread(one_torch_thread: None) -> None:
    """Every reliability test runs with torch on one thread (tests/conftest.py)."""


@pytest.fixture(scope="session")
def ledger() -> Iterator[Ledger]:
    book = Ledger()
    yield book
    out = os.environ.get(OUT_ENV)
    if out and book.cases:
        book.write(out)


@pytest.fixture
def serve_inproc(tiny_ckpt: Path) -> Iterator[Callable[..., tuple[str, LLM, ServerState]]]:
    """`serve_inproc(**ServerConfig fields)`: (url, llm, state) of an app on a thread here."""
    servers: list[InProcessServer] = []

    def start(sndbuf_bytes: int | None = None, **config: object) -> tuple[str, LLM, ServerState]:
        cfg = ServerConfig(model=str(tiny_ckpt), hardware="h100", **config)  # type: ignore[arg-type]
        llm = LLM(model=str(tiny_ckpt), **cfg.engine_kwargs())
        app = create_app(cfg, llm=llm)
        server = InProcessServer(app, sndbuf_bytes=sndbuf_bytes)
        servers.append(server)
        return server.start(), llm, app.state.splitphase

    yield start
    for server in servers:
        server.stop()
