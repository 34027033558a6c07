"""From a validated request to engine inputs: prompt token ids and `SamplingParams`.

Tokenization happens here, not in the engine, so a prompt that does not fit is a 400 that
names both numbers before any seat is taken.
"""

from __future__ import annotations

from collections.abc import Sequence

from splitphase.engine.sampling_params import MAX_SEED, SamplingParams, SamplingParamsError
from splitphase.model.tokenizer import Tokenizer
from splitphase.server.errors import bad_request
from splitphase.server.protocol import PromptInput, _Sampling


def completion_prompts(
    tokenizer: Tokenizer, prompt: PromptInput, vocab_size: int,
    max_model_len: int | None = None, max_prompts: int | None = None,
) -> list[tuple[list[int], str | None]]:
    """(token ids, original text or None) per prompt; text gets the bos as the engine adds it.

    With `max_model_len` and `max_prompts`, what cannot be served is refused before it is
    tokenized (a 4 MB prompt costs seconds of tokenizer time).
    """
    if isinstance(prompt, str):
        items: Sequence[str | list[int]] = [prompt]
    elif not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    elif isinstance(prompt[0], int):
        items = [list(prompt)]  # one token-id prompt
    else:
        items = prompt  # a batch of texts or of token-id lists
    if max_prompts is not None and len(items) > max_prompts:
        raise bad_request(f"the request has {len(items)} prompts; this server admits at most "
                          f"{max_prompts} sequences at once", "prompt")
    out: list[tuple[list[int], str | None]] = []
    add_bos = tokenizer.bos_token_id is not None
    for i, item in enumerate(items):
        if isinstance(item, str):
            if max_model_len is not None:
                check_text_fits(tokenizer, item, max_model_len, "prompt")
            out.append((tokenizer.encode(item, add_bos=add_bos), item))
        else:
            check_token_ids(item, vocab_size, f"prompt[{i}]" if len(items) > 1 else "prompt")
            out.append((list(item), None))
        if not out[-1][0]:
            raise bad_request(f"prompt {i} is empty", "prompt")
    return out


def check_text_fits(tokenizer: Tokenizer, text: str, max_model_len: int, param: str) -> None:
    """400 for a text that cannot fit the context whatever it tokenizes to (no tokenizing)."""
    per_token = tokenizer.max_token_chars
    if per_token is not None and len(text) > max_model_len * per_token:
        raise bad_request(
            f"the text has {len(text)} characters, so at least {-(-len(text) // per_token)} "
            f"tokens (a token covers at most {per_token} characters): more than the context "
            f"length {max_model_len}; shorten it", param, "context_length_exceeded")


def check_token_ids(ids: Sequence[int], vocab_size: int, where: str) -> None:
    """400 for ids outside the vocabulary."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(
            f"{where} has token ids {bad[:5]} outside the vocabulary [0, {vocab_size})", "prompt"
        )


def check_context(prompts: Sequence[list[int]], max_tokens: int, max_model_len: int,
                  param: str = "prompt") -> None:
    """400 when a prompt plus max_tokens does not fit the context."""
    for i, ids in enumerate(prompts):
        total = len(ids) + max_tokens
        if total > max_model_len:
            which = f"prompt {i}" if len(prompts) > 1 else "the prompt"
            raise bad_request(
                f"{which} has {len(ids)} tokens and max_tokens is {max_tokens}: {total} tokens "
                f"exceed the context length {max_model_len}; shorten the prompt or lower "
                "max_tokens",
                param, "context_length_exceeded",
            )


def logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    """OpenAI's logit_bias ({"token id": bias}, keys are JSON strings) as {id: bias}; a key
    that is not a token id of this vocabulary is a 400 (the range of the values is checked
    by SamplingParams)."""
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        token = int(key) if key.strip().isdecimal() else -1
        if not 0 <= token < vocab_size:
            raise bad_request(f"logit_bias keys must be token ids in [0, {vocab_size}), got "
                              f"{key!r}", "logit_bias")
        out[token] = value
    return out


def sampling_params(req: _Sampling, max_tokens: int, logprobs: int | None, vocab_size: int,
                    extra_stop_token_ids: Sequence[int] = ()) -> SamplingParams:
    """SamplingParams for a request; a value out of range is a 400 naming field and range."""
    bias = logit_bias(req.logit_bias, vocab_size)
    n = 1 if req.n is None else req.n
    if req.best_of is not None and req.best_of != n:
        raise bad_request(f"best_of must equal n ({n}) or be omitted, got {req.best_of}",
                          "best_of")
    seed = req.seed
    if seed is not None and -(2**63) <= seed < 0:
        seed %= MAX_SEED + 1  # OpenAI seeds are int64; ours are uint64
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            seed=seed,
            stop=req.stop or (),
            stop_token_ids=[*(req.stop_token_ids or []), *extra_stop_token_ids],
            ignore_eos=bool(req.ignore_eos),
            logprobs=logprobs,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            n=n,
            logit_bias=tuple(bias.items()),
        )
    except SamplingParamsError as exc:
        message = str(exc)
        raise bad_request(message, message.split(" ", 1)[0]) from exc


def checked_max_tokens(value: int | None, default: int, name: str = "max_tokens",
                       allow_zero: bool = False) -> int:
    """The requested max tokens (or the default); 0 only where echo scoring allows it."""
    if value is None:
        return default
    lo = 0 if allow_zero else 1
    if value < lo:
        hint = " (0 only with echo, for scoring)" if not allow_zero else ""
        raise bad_request(f"{name} must be >= {lo}{hint}, got {value}", name)
    return value
