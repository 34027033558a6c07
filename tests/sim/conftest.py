import pytest
import torch

from splitphase.model.config import ModelConfig
from splitphase.model.tokenizer import Tokenizer
from splitphase.model.transformer import Transformer


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return Tokenizer.default()


@pytest.fixture(scope="session")
def tiny_model(tokenizer) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig.from_name("tiny").with_(vocab_size=tokenizer.vocab_size)
    return Transformer(cfg).eval()
