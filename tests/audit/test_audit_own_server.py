"""`splitphase audit --target openai:` against our own `splitphase serve`: a valid report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from splitphase.audit.report.schema import validate_report
from splitphase.cli import main
from splitphase.model.checkpoint import save_checkpoint
from splitphase.model.config import ModelConfig
from splitphase.model.tokenizer import Tokenizer
from splitphase.model.transformer import Transformer
from splitphase.server.process import ServerProcess


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    cfg = ModelConfig.from_name("tiny").with_(vocab_size=Tokenizer.default().vocab_size)
    return save_checkpoint(Transformer(cfg), tmp_path_factory.mktemp("tiny"))


def test_audit_of_our_server_validates(tiny_ckpt: Path, tmp_path: Path) -> None:
    server = ServerProcess(["--model", str(tiny_ckpt), "--hardware", "h100"],
                           env={"OMP_NUM_THREADS": "1"})
    with server as url:
        code = main(["audit", "--target", f"openai:{url}", "--model-config", str(tiny_ckpt),
                     "--hardware", "cpu", "--quick", "--out", str(tmp_path), "--no-progress"])
        log = server.log()
    assert code == 0, log
    doc = json.loads((tmp_path / "report.json").read_text())
    validate_report(doc)
    assert doc["target"]["server_metrics"] is True  # our splitphase:* histograms were scraped
