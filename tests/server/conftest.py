"""Fixtures: a random tiny checkpoint, and `splitphase serve` on it in a child process."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from splitphase.model.checkpoint import save_checkpoint
from splitphase.model.config import ModelConfig
from splitphase.model.tokenizer import Tokenizer
from splitphase.model.transformer import Transformer
from splitphase.server.process import ServerProcess

# One torch thread in every server: the CI box has two cores shared with other work.
SERVER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    cfg = ModelConfig.from_name("tiny").with_(vocab_size=Tokenizer.default().vocab_size)
    return save_checkpoint(Transformer(cfg), tmp_path_factory.mktemp("tiny"))


def start_server(ckpt: Path, *extra: str) -> ServerProcess:
    """A started server on the checkpoint (h100 peaks: no CPU calibration at startup)."""
    proc = ServerProcess(["--model", str(ckpt), "--hardware", "h100", *extra], env=SERVER_ENV)
    proc.start()
    return proc


@pytest.fixture(scope="session")
def launch() -> Callable[..., ServerProcess]:
    """`launch(ckpt, *serve_args)`: start another server (the test stops it)."""
    return start_server


@pytest.fixture(scope="module")
def server(tiny_ckpt: Path) -> Iterator[ServerProcess]:
    proc = start_server(tiny_ckpt, "--max-num-seqs", "32")
    yield proc
    assert proc.stop() == 0, proc.log()
