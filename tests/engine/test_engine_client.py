"""The engine core process behind `EngineCoreClient`: tokens, errors and aborts as in-process."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from splitphase.engine.async_engine import AsyncEngine, EngineDeadError, EngineStepError
from splitphase.engine.engine_client import EngineCoreClient, EngineCoreDiedError
from splitphase.engine.engine_core import build_engine, engine_factory
from splitphase.engine.llm import LLM
from splitphase.engine.llm_engine import LLMEngine, StepFailedError
from splitphase.engine.sampling_params import SamplingParams
from splitphase.errors import UserError
from splitphase.model.checkpoint import read_config
from splitphase.model.tokenizer import Tokenizer

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPTS = [f"Prompt {i} is about" + " the river" * i for i in range(5)]


def flaky_engine(model: str, fail_on_call: int) -> LLMEngine:
    """In the core: an engine whose forward raises on its `fail_on_call`-th call only."""
    engine = build_engine(model, "cpu", None, {"max_num_seqs": 4})
    real, calls = engine.runner.execute, [0]

    def execute(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == fail_on_call:
            raise RuntimeError("injected forward failure")
        return real(*args, **kwargs)

    engine.runner.execute = execute  # type: ignore[method-assign]
    return engine


@pytest.fixture(scope="module")
def core_llm(tiny_ckpt: Path) -> Iterator[LLM]:
    llm = LLM(str(tiny_ckpt), device="cpu", engine_process=True, max_num_seqs=4)
    yield llm
    llm.close()


def test_greedy_text_and_step_records_equal_in_process(core_llm: LLM, tiny_ckpt: Path) -> None:
    local = LLM(str(tiny_ckpt), device="cpu", max_num_seqs=4)
    expected = local.generate(PROMPTS, GREEDY)
    got = core_llm.generate(PROMPTS, GREEDY)
    assert [c.text for c in got] == [c.text for c in expected]
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert got[0].timings.ttft_s is not None and got[0].timings.ttft_s > 0
    # The records came over the pipe (the schedules differ: requests reach the core one by one).
    prompt_tokens = sum(len(c.output.prompt_token_ids) for c in got)
    assert 0 < sum(s.num_prefill_tokens for s in core_llm.steps) <= prompt_tokens
    assert all(s.wall_s > 0 and s.flops > 0 for s in core_llm.steps)
    engine = core_llm.engine
    assert isinstance(engine, EngineCoreClient)
    assert engine.state.num_used_blocks == 0 and engine.state.num_blocks > 0
    assert (engine.kv_pool_blocks, engine.kv_block_size) == (engine.state.num_blocks, 16)
    assert not engine.has_unfinished_requests()


def test_the_dtype_is_known_here_while_the_model_lives_in_the_core(
    core_llm: LLM, tiny_ckpt: Path
) -> None:
    # What `serve` states (model_config_info, cache_config_info's "auto") and prices.
    assert core_llm.model is None
    assert core_llm.dtype == read_config(tiny_ckpt)[0].dtype == "float32"
    with LLM(str(tiny_ckpt), device="cpu", dtype="bfloat16", engine_process=True) as bf16:
        assert bf16.dtype == "bfloat16"
        assert bf16.generate(["In the beginning"], GREEDY)[0].token_ids


def test_a_bad_prompt_raises_the_engines_error_here(core_llm: LLM) -> None:
    with pytest.raises(UserError, match="context length"):
        core_llm.engine.add_request([1] * 5000, GREEDY)
    assert not core_llm.engine.has_unfinished_requests()


def test_abort_frees_blocks_before_the_next_step(core_llm: LLM) -> None:
    engine = core_llm.engine
    assert isinstance(engine, EngineCoreClient)
    rid = engine.add_request("a long one", SamplingParams(max_tokens=200, ignore_eos=True))
    while engine.state.num_used_blocks == 0:
        engine.step()
    handled_before = engine.state.commands_handled  # the add, and every earlier command
    engine.abort_request(rid)
    reflected = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        # Steps the core ran before it read the abort may still be in the pipe; from the first
        # message that counts the abort on, its blocks are free and the request has ended.
        if engine.state.commands_handled > handled_before:
            reflected += 1
            assert engine.state.num_used_blocks == 0 and engine.state.num_running == 0
            assert all(o.finished for o in outputs if o.request_id == rid)
    assert reflected >= 1


def test_a_failed_forward_ends_its_requests_and_the_core_goes_on(tiny_ckpt: Path,
                                                                 tokenizer: Tokenizer) -> None:
    client = EngineCoreClient.launch(functools.partial(flaky_engine, str(tiny_ckpt), 2),
                                     tokenizer)
    try:
        rids = [client.add_request(p, GREEDY) for p in PROMPTS[:3]]
        with pytest.raises(StepFailedError) as failed:
            while client.has_unfinished_requests():  # the first forward works, the second not
                client.step()
        # The failed step's requests end; which of the three had reached the core by its
        # second forward depends on timing (they arrive one by one), so the others may still
        # run, and must then finish whole.
        ended = set(failed.value.request_ids)
        assert ended and ended <= set(rids)
        assert "injected forward failure" in repr(failed.value.cause)
        rest = []
        while client.has_unfinished_requests():
            rest += [o for o in client.step() if o.finished]
        assert {o.request_id for o in rest} == set(rids) - ended
        assert all(len(o.token_ids) == GREEDY.max_tokens for o in rest)
        assert client.state.num_used_blocks == 0
        rid = client.add_request("after the failure", GREEDY)
        outs = []
        while client.has_unfinished_requests():
            outs += [o for o in client.step() if o.request_id == rid]
        assert outs[-1].finished and len(outs[-1].token_ids) == GREEDY.max_tokens
    finally:
        client.close()


def test_async_engine_streams_errors_from_the_core(tiny_ckpt: Path, tokenizer: Tokenizer) -> None:
    client = EngineCoreClient.launch(functools.partial(flaky_engine, str(tiny_ckpt), 2),
                                     tokenizer)
    engine = AsyncEngine(client)
    engine.start()

    async def run(rid: str) -> list[str]:
        return [o.delta async for o in engine.generate("hello", GREEDY, rid)]

    try:
        with pytest.raises(EngineStepError, match="injected forward failure"):
            asyncio.run(run("first"))
        assert len(asyncio.run(run("second"))) == GREEDY.max_tokens
    finally:
        engine.shutdown()
        client.close()


def test_a_killed_core_is_reported_dead(tiny_ckpt: Path, tokenizer: Tokenizer) -> None:
    client = EngineCoreClient.launch(engine_factory(str(tiny_ckpt), "cpu", None, {}), tokenizer)
    try:
        os.kill(client.proc.pid, signal.SIGKILL)
        client.proc.wait(10)
        with pytest.raises(EngineCoreDiedError, match="exited with code -9"):
            client.has_unfinished_requests()
        with pytest.raises(EngineDeadError):
            client.add_request("x", GREEDY)
    finally:
        client.close()


def test_a_model_that_does_not_load_fails_the_launch_with_its_error() -> None:
    with pytest.raises(UserError):
        LLM("no-such-model-anywhere", device="cpu", engine_process=True)
