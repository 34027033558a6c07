"""Fixtures of the reliability suite: a tiny checkpoint, servers, and the ledger of figures.

Set SPLITPHASE_RELIABILITY_OUT=path.json to keep the ledger (tools/reliability_report.py does,
then renders the README section from it).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from splitphase.engine.llm import LLM
from splitphase.model.checkpoint import save_checkpoint
from splitphase.model.config import ModelConfig
from splitphase.model.tokenizer import Tokenizer
from splitphase.model.transformer import Transformer
from splitphase.reliability.inproc import InProcessServer
from splitphase.reliability.ledger import Ledger
from splitphase.server.app import create_app
from splitphase.server.config import ServerConfig
from splitphase.server.process import ServerProcess
from splitphase.server.state import ServerState

SERVER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
OUT_ENV = "SPLITPHASE_RELIABILITY_OUT"


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def ledger() -> Iterator[Ledger]:
    book = Ledger()
    yield book
    out = os.environ.get(OUT_ENV)
    if out and book.cases:
        book.write(out)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    cfg = ModelConfig.from_name("tiny").with_(vocab_size=Tokenizer.default().vocab_size)
    return save_checkpoint(Transformer(cfg), tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def launch() -> Callable[..., ServerProcess]:
    """`launch(model, *serve_args)`: a started `splitphase serve` child on 127.0.0.1."""

    def start(model: str | Path, *extra: str) -> ServerProcess:
        proc = ServerProcess(["--model", str(model), "--hardware", "h100", *extra],
                             host="127.0.0.1", env=SERVER_ENV)
        proc.start()
        return proc

    return start


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
