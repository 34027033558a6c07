"""How one request wants its tokens sampled: a validated, immutable dataclass (vLLM vocabulary).

Plain Python (no torch) so the server, the scheduler and the simulator can all use it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

MAX_N = 16  # parallel samples per request; each is a sequence holding KV blocks
MAX_LOGPROBS = 20  # top-N log-probabilities per token, as the OpenAI API allows
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes a uint64
# Every stop string is searched after every token on the engine thread, which all requests
# share: thousands of them would slow everyone (OpenAI allows 4; lm-eval sends a handful).
MAX_STOP = 64
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for one token's bias: -100 bans it, 100 forces it


class SamplingParamsError(ValueError):
    """A sampling parameter out of range; the message names the field, the value and the range."""


def _fail(name: str, value: object, allowed: str) -> SamplingParamsError:
    return SamplingParamsError(f"{name} must be {allowed}, got {value!r}")


def _check_int(name: str, value: object, lo: int, hi: int | None, allowed: str) -> None:
    # bool is a subclass of int; `n=True` is a bug in the caller, not a 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(name, value, f"an integer {allowed}")
    if value < lo or (hi is not None and value > hi):
        raise _fail(name, value, allowed)


def _check_float(
    name: str, value: object, lo: float, hi: float | None, allowed: str, lo_open: bool = False
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(name, value, f"a number {allowed}")
    if not math.isfinite(value):
        raise _fail(name, value, f"a finite number {allowed}")
    if value < lo or (lo_open and value == lo) or (hi is not None and value > hi):
        raise _fail(name, value, allowed)


# Temperatures below this sample greedily, as vLLM's _SAMPLING_EPS: logits divided by a tiny
# positive temperature overflow to inf and the softmax to NaN (5e-324 failed the whole engine
# step, every request in it), and the distribution is argmax's long before that anyway.
GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """Sampling controls of one request; validated at construction, immutable afterwards."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy (argmax)
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1, as vLLM accepts) means off; stored as 0
    min_p: float = 0.0
    seed: int | None = None
    # A list, a tuple or one string (a str is a Sequence[str]); both stored as tuples.
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0..MAX_LOGPROBS: the sampled token plus top-N
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    n: int = 1
    # Added to a token's logit before sampling (OpenAI's logit_bias): (token id, bias) pairs
    # (a {id: bias} dict is accepted too), stored sorted by id (immutable, JSON-friendly).
    logit_bias: Sequence[tuple[int, float]] = ()

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, 1, None, ">= 1")
        _check_float("temperature", self.temperature, 0.0, None, ">= 0 (0 means greedy)")
        _check_float("top_p", self.top_p, 0.0, 1.0, "in (0, 1]", lo_open=True)
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        _check_int("top_k", self.top_k, 0, None, "0 or -1 (off) or >= 1")
        _check_float("min_p", self.min_p, 0.0, 1.0, "in [0, 1]")
        if self.seed is not None:
            _check_int("seed", self.seed, 0, MAX_SEED, f"None or in [0, {MAX_SEED}]")
        object.__setattr__(self, "stop", self._normalize_stop(self.stop))
        object.__setattr__(self, "stop_token_ids", self._normalize_ids(self.stop_token_ids))
        if not isinstance(self.ignore_eos, bool):
            raise _fail("ignore_eos", self.ignore_eos, "True or False")
        if self.logprobs is not None:
            allowed = f"None or in [0, {MAX_LOGPROBS}]"
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS, allowed)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0, "in [-2, 2]")
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "in [-2, 2]")
        _check_int("n", self.n, 1, MAX_N, f"in [1, {MAX_N}]")
        object.__setattr__(self, "logit_bias", self._normalize_bias(self.logit_bias))

    @staticmethod
    def _normalize_stop(stop: object) -> tuple[str, ...]:
        if stop is None:
            return ()
        items = (stop,) if isinstance(stop, str) else stop
        if not isinstance(items, (list, tuple)):
            raise _fail("stop", stop, "a string or a list of strings")
        if len(items) > MAX_STOP:
            raise SamplingParamsError(
                f"stop must hold at most {MAX_STOP} strings, got {len(items)}"
            )
        for s in items:
            # An empty stop string would match before the first token (vLLM rejects it too).
            if not isinstance(s, str) or not s:
                raise _fail("stop", stop, "a string or a list of non-empty strings")
        return tuple(items)

    @staticmethod
    def _normalize_ids(ids: object) -> tuple[int, ...]:
        if ids is None:
            return ()
        if not isinstance(ids, (list, tuple)):
            raise _fail("stop_token_ids", ids, "a list of token ids (integers >= 0)")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise _fail("stop_token_ids", ids, "a list of token ids (integers >= 0)")
        return tuple(ids)

    @staticmethod
    def _normalize_bias(bias: object) -> tuple[tuple[int, float], ...]:
        if bias is None:
            return ()
        pairs = list(bias.items()) if isinstance(bias, Mapping) else bias
        allowed = "a map of token ids (integers >= 0) to biases in [-100, 100]"
        if not isinstance(pairs, (list, tuple)):
            raise _fail("logit_bias", bias, allowed)
        out: dict[int, float] = {}
        for pair in pairs:
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise _fail("logit_bias", bias, allowed)
            token, value = pair
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise _fail("logit_bias", bias, allowed)
            _check_float(f"logit_bias[{token}]", value, -LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT,
                         "in [-100, 100]")
            out[token] = float(value)
        return tuple(sorted(out.items()))

    @property
    def is_greedy(self) -> bool:
        """True when sampling is argmax: temperature 0, or below GREEDY_BELOW_TEMPERATURE."""
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict (tuples become lists); `SamplingParams(**d)` round-trips."""
        d = asdict(self)
        d["stop"] = list(self.stop)
        d["stop_token_ids"] = list(self.stop_token_ids)
        d["logit_bias"] = [list(pair) for pair in self.logit_bias]
        return d
