"""Deltas of step outputs rebuild the same cumulative RequestOutputs (engine_wire.py)."""

from __future__ import annotations

import pickle

from splitphase.engine.config import EngineConfig
from splitphase.engine.engine_wire import DeltaDecoder, DeltaEncoder
from splitphase.engine.llm_engine import LLMEngine
from splitphase.engine.sampling_params import SamplingParams


def test_deltas_rebuild_every_output(tiny_model, tokenizer) -> None:
    engine = LLMEngine(tiny_model, tokenizer, EngineConfig(num_blocks=64, max_num_seqs=2))
    engine.add_request("the river and the", SamplingParams(max_tokens=7, logprobs=2, seed=1))
    engine.add_request([0, 5, 6, 7], SamplingParams(max_tokens=5, n=2, seed=2),
                       prompt_logprobs=1)
    enc, dec = DeltaEncoder(), DeltaDecoder()
    seen = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            # Through pickle, as over the pipe: nothing may lean on object identity.
            got = dec.decode(pickle.loads(pickle.dumps(enc.encode(out))))
            assert (got.request_id, got.prompt_token_ids, got.token_ids, got.text, got.delta,
                    got.finished, got.finish_reason, got.logprobs, got.prompt_logprobs) == (
                out.request_id, out.prompt_token_ids, out.token_ids, out.text, out.delta,
                out.finished, out.finish_reason, out.logprobs, out.prompt_logprobs)
            assert got.request is not None
            if out.finished:
                assert out.request is not None
                assert got.request.inter_token_s == out.request.inter_token_s
                assert got.request.ttft_s == out.request.ttft_s
            seen += 1
    assert seen > 3
    assert not enc._sent and not dec._totals  # finished requests leave no totals behind
