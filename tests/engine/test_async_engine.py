import asyncio
import concurrent.futures
import threading

import pytest

from splitphase.engine.async_engine import AsyncEngine, EngineStepError
from splitphase.engine.config import EngineConfig
from splitphase.engine.llm_engine import LLMEngine
from splitphase.engine.sampling_params import SamplingParams
from splitphase.errors import UserError

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture
def async_engine(tiny_model, tokenizer):
    eng = AsyncEngine(LLMEngine(tiny_model, tokenizer, EngineConfig(num_blocks=64)))
    eng.start()
    yield eng
    eng.shutdown()


async def _collect(eng, prompt, rid, params=GREEDY):
    outs = [o async for o in eng.generate(prompt, params, rid)]
    return outs[-1]


def test_concurrent_streams_match_reference(async_engine, tiny_model):
    prompts = [[0, *range(5, 5 + n)] for n in (3, 12, 30)]

    async def main():
        return await asyncio.gather(
            *[_collect(async_engine, p, f"r{i}") for i, p in enumerate(prompts)]
        )

    finals = asyncio.run(main())
    assert [f.token_ids for f in finals] == [tiny_model.generate(p, 8) for p in prompts]
    assert async_engine.engine.scheduler.block_manager.num_used_blocks == 0


def test_a_command_whose_caller_gave_up_still_runs_and_the_loop_lives(async_engine):
    """A caller cancelled by a client timeout cancels its command's future; setting a result
    on it crashed the engine loop (every later request 503)."""
    ran = threading.Event()
    gave_up: concurrent.futures.Future[None] = concurrent.futures.Future()
    gave_up.cancel()
    async_engine._put_command(ran.set, gave_up)
    assert ran.wait(5)  # an abort whose caller left must still take effect
    final = asyncio.run(_collect(async_engine, [0, 5, 6], "after"))
    assert len(final.token_ids) == 8 and async_engine.is_running


def test_bad_request_raises_to_caller(async_engine):
    async def main():
        await _collect(async_engine, [1] * 300, "big")

    with pytest.raises(UserError, match="context length"):
        asyncio.run(main())


def test_caller_stopping_aborts_and_frees_blocks(async_engine):
    async def main():
        agen = async_engine.generate(
            [0, 5, 6], SamplingParams(max_tokens=200, ignore_eos=True), "x"
        )
        await agen.__anext__()
        await agen.aclose()
        for _ in range(100):
            await asyncio.sleep(0.01)
            if async_engine.engine.scheduler.block_manager.num_used_blocks == 0:
                return True
        return False

    assert asyncio.run(main())


def test_failing_forward_errors_its_requests_then_serves_next(async_engine, monkeypatch):
    runner = async_engine.engine.runner
    real = runner.execute
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", flaky)

    async def main():
        with pytest.raises(EngineStepError, match="injected"):
            await _collect(async_engine, [0, 5, 6], "a")
        return await _collect(async_engine, [0, 5, 6], "b")

    final = asyncio.run(main())
    assert final.finished and len(final.token_ids) == 8
    assert async_engine.engine.scheduler.block_manager.num_used_blocks == 0


def test_generate_all_merges_prompts_on_one_stream(async_engine, tiny_model):
    prompts = [[0, *range(5, 5 + n)] for n in (3, 12, 30)]
    rids = ["m-0", "m-1", "m-2"]

    async def main():
        finals = {}
        async for out in async_engine.generate_all(prompts, GREEDY, rids):
            assert out.request_id not in finals  # nothing after a request's final output
            if out.finished:
                finals[out.request_id] = out
        return finals

    finals = asyncio.run(main())
    assert [finals[r].token_ids for r in rids] == [tiny_model.generate(p, 8) for p in prompts]
    assert async_engine.num_in_flight == 0


def test_generate_all_adds_all_or_none(async_engine):
    long = SamplingParams(max_tokens=200, ignore_eos=True)  # would still run when checked

    async def main():
        with pytest.raises(UserError, match="context length"):
            await anext(async_engine.generate_all([[0, 5, 6], [1] * 300], long, ["ok", "big"]))
        # The request added before the bad one was taken back.
        return async_engine.engine.has_unfinished_requests()

    assert asyncio.run(main()) is False
    assert async_engine.engine.scheduler.block_manager.num_used_blocks == 0


def test_generate_all_stopping_early_aborts_every_prompt(async_engine):
    params = SamplingParams(max_tokens=200, ignore_eos=True, n=2)

    async def main():
        agen = async_engine.generate_all([[0, 5, 6], [0, 7, 8, 9]], params, ["s-0", "s-1"])
        await anext(agen)
        await agen.aclose()
        for _ in range(100):
            await asyncio.sleep(0.01)
            if not async_engine.engine.has_unfinished_requests():
                return async_engine.engine.scheduler.block_manager.num_used_blocks
        return -1

    assert asyncio.run(main()) == 0


def test_caller_cancelled_while_its_add_waits_aborts_it(async_engine):
    """A client that disconnects before the engine thread took its add: the add still runs,
    and its abort must follow it (the request ran to max_tokens for nobody)."""
    busy, release = threading.Event(), threading.Event()
    hold: concurrent.futures.Future[None] = concurrent.futures.Future()
    async_engine._put_command(lambda: (busy.set(), release.wait(5)), hold)
    assert busy.wait(5)  # the engine thread is inside a command: the add below must queue
    params = SamplingParams(max_tokens=200, ignore_eos=True)

    async def main():
        task = asyncio.create_task(anext(async_engine.generate([0, 5, 6], params, "gone")))
        await asyncio.sleep(0.05)  # the task now awaits its add
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        # Commands run in order: the add, its abort, then this one.
        await async_engine.call(lambda: None)
        return async_engine.engine.has_unfinished_requests()

    assert asyncio.run(main()) is False
