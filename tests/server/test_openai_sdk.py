"""The real `openai` SDK against `splitphase serve` on a random tiny model."""

from __future__ import annotations

import math
from pathlib import Path

import openai
import pytest

from splitphase.model.tokenizer import Tokenizer
from splitphase.server.process import ServerProcess

TOK = Tokenizer.default()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def model(tiny_ckpt: Path) -> str:
    return str(tiny_ckpt)


def test_models_lists_the_served_model(client: openai.OpenAI, model: str) -> None:
    cards = client.models.list().data
    assert [c.id for c in cards] == [model]
    assert cards[0].model_extra["max_model_len"] == 256


def test_completion_with_usage_and_timings(client: openai.OpenAI, model: str) -> None:
    out = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert out.object == "text_completion" and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 8
    assert out.usage.prompt_tokens == len(TOK.encode("Once upon a time", add_bos=True))
    timings = out.usage.model_extra["timings"]
    assert timings["ttft_s"] > 0 and timings["decode_s"] >= 0 and timings["tpot_s"] > 0
    assert timings["queue_s"] + timings["prefill_s"] == pytest.approx(timings["ttft_s"])


def test_chat_completion(client: openai.OpenAI, model: str) -> None:
    out = client.chat.completions.create(
        model=model, messages=[{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "Hi <|user|> there"}],
        max_tokens=6, temperature=0, user="someone",
    )
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert isinstance(out.choices[0].message.content, str)
    assert 1 <= out.usage.completion_tokens <= 6


def test_streaming_chat_equals_non_streamed_for_the_same_seed(client: openai.OpenAI,
                                                              model: str) -> None:
    kwargs = dict(model=model, messages=[{"role": "user", "content": "Tell me a story"}],
                  max_tokens=24, temperature=1.0, seed=1234)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == whole.choices[0].finish_reason and set(reasons[:-1]) == {None}


def test_streamed_completion_usage_and_first_chunk_carries_a_token(client: openai.OpenAI,
                                                                   model: str) -> None:
    chunks = list(client.completions.create(
        model=model, prompt="abc", max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    token_chunks = [c for c in chunks if c.choices]
    assert len(token_chunks) == 5  # one chunk per token, the first one included
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5


def test_n_2_gives_two_choices(client: openai.OpenAI, model: str) -> None:
    out = client.completions.create(model=model, prompt="x", max_tokens=6, n=2, seed=7,
                                    temperature=1.0, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.completion_tokens == 12
    chat = client.chat.completions.create(model=model, n=2, max_tokens=4, seed=3,
                                          messages=[{"role": "user", "content": "hey"}])
    assert [c.index for c in chat.choices] == [0, 1]


def test_seeded_sampling_is_deterministic(client: openai.OpenAI, model: str) -> None:
    def run(seed: int) -> str:
        out = client.completions.create(model=model, prompt="The", max_tokens=16, seed=seed,
                                        temperature=1.0, top_p=0.9,
                                        extra_body={"ignore_eos": True})
        return out.choices[0].text

    assert run(42) == run(42)
    assert run(42) != run(43)


def test_logprobs_completions_and_chat(client: openai.OpenAI, model: str) -> None:
    out = client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0,
                                    logprobs=3, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen <= 0 and len(top) >= 3
        assert chosen == pytest.approx(max(top.values()))  # greedy: the top token
    assert lp.text_offset == sorted(lp.text_offset)
    chat = client.chat.completions.create(model=model, max_tokens=3, temperature=0,
                                          logprobs=True, top_logprobs=2,
                                          messages=[{"role": "user", "content": "hi"}])
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.bytes is not None for t in content)


def test_echo_scoring_on_token_ids_like_lm_eval(client: openai.OpenAI, model: str) -> None:
    context, continuation = [0, *range(300, 340)], [500, 501, 502]
    ids = context + continuation

    def score(max_tokens: int) -> openai.types.Completion:
        return client.completions.create(model=model, prompt=[ids], max_tokens=max_tokens,
                                         echo=True, logprobs=1, temperature=0, seed=1)

    first = score(1)
    lp = first.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None
    assert first.usage.prompt_tokens == len(ids) and first.usage.completion_tokens == 1
    # lm-evaluation-harness: sum(token_logprobs[ctxlen:-1]), greedy check on top_logprobs.
    total = sum(lp.token_logprobs[len(context):-1])
    assert math.isfinite(total) and total < 0
    for tok, top in zip(lp.token_logprobs[len(context):-1], lp.top_logprobs[len(context):-1],
                        strict=True):
        assert tok <= max(top.values()) + 1e-6
    text = first.choices[0].text  # text_offset indexes the echoed text (the bos is not in it)
    offsets = lp.text_offset
    assert offsets[0] == offsets[1] == 0
    for i in range(1, len(ids)):
        assert text[offsets[i] : offsets[i + 1]] == lp.tokens[i]
    # The same context again hits the prefix cache: the numbers must not change.
    again = score(0).choices[0].logprobs
    assert len(again.token_logprobs) == len(ids)
    assert again.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1 : len(ids)], abs=1e-4)
    assert score(0).usage.completion_tokens == 0


def test_stop_strings_and_penalties_are_accepted(client: openai.OpenAI, model: str) -> None:
    base = client.completions.create(model=model, prompt="a b c", max_tokens=12,
                                     temperature=0, extra_body={"ignore_eos": True})
    text = base.choices[0].text
    stop = text[3:5] if len(text) >= 5 else text[-1:]
    out = client.completions.create(model=model, prompt="a b c", max_tokens=12, temperature=0,
                                    stop=[stop, "\n\n\n"], presence_penalty=0.0,
                                    frequency_penalty=0.0, extra_body={"ignore_eos": True})
    assert out.choices[0].text == text[: text.index(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_logit_bias_bans_and_forces_tokens(client: openai.OpenAI, model: str) -> None:
    kwargs = dict(model=model, prompt="a b c", max_tokens=4, temperature=0, logprobs=0,
                  extra_body={"ignore_eos": True})
    first = client.completions.create(**kwargs).choices[0].logprobs.tokens[0]  # type: ignore[call-overload]
    ids = [i for i in range(TOK.vocab_size) if TOK.decode([i]) == first]  # the greedy token
    ban = {str(i): -100 for i in ids}
    banned = client.completions.create(**kwargs, logit_bias=ban)  # type: ignore[call-overload]
    assert ids and banned.choices[0].logprobs.tokens[0] != first
    word = next(i for i in range(TOK.vocab_size) if TOK.decode([i]) == " the")
    forced = client.chat.completions.create(model=model, max_tokens=3, temperature=1.0,
                                            messages=[{"role": "user", "content": "hi"}],
                                            logit_bias={str(word): 100})
    assert forced.choices[0].message.content == " the" * 3


def test_streamed_echo_n2_logprobs_equal_non_streamed(client: openai.OpenAI, model: str) -> None:
    kwargs = dict(model=model, prompt="Scores: one two", max_tokens=5, n=2, seed=11, echo=True,
                  logprobs=2, temperature=1.0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    texts: dict[int, str] = {0: "", 1: ""}
    tokens: dict[int, list[str]] = {0: [], 1: []}
    offsets: dict[int, list[int]] = {0: [], 1: []}
    for chunk in client.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
            tokens[c.index] += c.logprobs.tokens
            offsets[c.index] += c.logprobs.text_offset
    for choice in whole.choices:
        assert texts[choice.index] == choice.text
        assert tokens[choice.index] == choice.logprobs.tokens
        assert offsets[choice.index] == choice.logprobs.text_offset
        assert choice.text.startswith("Scores: one two")
