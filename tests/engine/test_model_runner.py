"""The model runner puts a CPU model's large weights on huge pages, and serves it the same."""

from __future__ import annotations

import copy

import pytest
import torch

from splitphase.engine.config import EngineConfig
from splitphase.engine.llm_engine import LLMEngine
from splitphase.engine.sampling_params import SamplingParams
from splitphase.hardware.huge_pages import HUGE_PAGE_BYTES, transparent_huge_pages
from splitphase.model.config import ModelConfig
from splitphase.model.tokenizer import Tokenizer
from splitphase.model.transformer import Transformer


@pytest.mark.skipif(not transparent_huge_pages(), reason="THP off on this kernel")
def test_engine_serves_its_weights_from_huge_pages_with_the_same_tokens(
    tokenizer: Tokenizer,
) -> None:
    torch.manual_seed(0)
    # d_model 128: the embedding (4096 x 128 fp32) is one huge page, the layers are smaller
    cfg = ModelConfig.from_name("tiny").with_(vocab_size=tokenizer.vocab_size, d_model=128)
    model = Transformer(cfg).eval()
    reference = copy.deepcopy(model)
    engine = LLMEngine(model, tokenizer, EngineConfig(num_blocks=64, max_num_seqs=4))
    assert model.embed_tokens.weight.data_ptr() % HUGE_PAGE_BYTES == 0
    prompts = [[0, *range(5, 5 + n)] for n in (4, 19)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    with torch.inference_mode():
        assert [done[i] for i in ids] == [reference.generate(p, 8) for p in prompts]
