"""SamplingParams: defaults, normalization, and one clear error per bad field."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitphase.engine.sampling_params import (
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP,
    SamplingParams,
    SamplingParamsError,
)


def test_defaults_are_valid_and_serializable() -> None:
    sp = SamplingParams()
    assert sp.max_tokens == 16 and sp.n == 1 and sp.top_k == 0 and not sp.is_greedy
    assert SamplingParams(**sp.to_dict()) == sp


def test_greedy_and_top_k_minus_one_means_off() -> None:
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=5).top_k == 5


def test_stop_accepts_a_single_string_or_a_list() -> None:
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    assert SamplingParams(stop=["a"]).to_dict()["stop"] == ["a"]


def test_logit_bias_is_sorted_pairs_from_a_dict_or_pairs_and_round_trips() -> None:
    sp = SamplingParams(logit_bias={9: -100, 2: 0.5})
    assert sp.logit_bias == ((2, 0.5), (9, -100.0))
    assert SamplingParams(logit_bias=[(9, -100), (2, 0.5)]) == sp
    assert SamplingParams(**sp.to_dict()) == sp and sp.to_dict()["logit_bias"] == [[2, 0.5],
                                                                                   [9, -100.0]]


@pytest.mark.parametrize("bias", [100.5, -math.inf, math.nan, "1", True])
def test_a_bad_logit_bias_value_names_its_token(bias: object) -> None:
    with pytest.raises(SamplingParamsError, match=r"^logit_bias\[5\] must be .*got"):
        SamplingParams(logit_bias={3: 1.0, 5: bias})


def test_frozen() -> None:
    sp = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        sp.max_tokens = 3  # type: ignore[misc]
    # replace() re-validates.
    with pytest.raises(SamplingParamsError):
        dataclasses.replace(sp, max_tokens=0)


BAD = [
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 2.0), ("max_tokens", True),
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf),
    ("temperature", "1"), ("temperature", True),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", math.nan),
    ("top_k", -2), ("top_k", 1.5), ("top_k", False),
    ("min_p", -0.01), ("min_p", 1.5), ("min_p", -math.inf),
    ("seed", -1), ("seed", 2**64), ("seed", 1.0), ("seed", True),
    ("stop", [""]), ("stop", [1]), ("stop", 5), ("stop", ""),
    ("stop_token_ids", [-1]), ("stop_token_ids", [True]), ("stop_token_ids", 3),
    ("ignore_eos", 1), ("ignore_eos", "yes"),
    ("logprobs", -1), ("logprobs", MAX_LOGPROBS + 1), ("logprobs", True),
    ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("presence_penalty", math.nan),
    ("frequency_penalty", 3), ("frequency_penalty", math.inf),
    ("n", 0), ("n", MAX_N + 1), ("n", True), ("n", 2.0),
    ("logit_bias", {-1: 1.0}), ("logit_bias", {True: 1.0}), ("logit_bias", {"5": 1.0}),
    ("logit_bias", [(5,)]), ("logit_bias", 5),
]


@pytest.mark.parametrize(("name", "value"), BAD)
def test_bad_field_names_field_value_and_range(name: str, value: object) -> None:
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**{name: value})
    msg = str(err.value)
    assert msg.startswith(f"{name} must be") and repr(value) in msg and "got" in msg
    assert isinstance(err.value, ValueError)


def test_too_many_stop_strings_name_the_limit_not_the_list() -> None:
    assert len(SamplingParams(stop=[f"s{i}" for i in range(MAX_STOP)]).stop) == MAX_STOP
    with pytest.raises(SamplingParamsError, match=f"at most {MAX_STOP} strings, got 5000$"):
        SamplingParams(stop=[f"s{i}" for i in range(5000)])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"top_p": 1.0}, {"top_p": 1e-6}, {"min_p": 0.0}, {"min_p": 1.0}, {"seed": 0},
        {"seed": 2**64 - 1}, {"logprobs": 0}, {"logprobs": MAX_LOGPROBS}, {"n": MAX_N},
        {"presence_penalty": -2}, {"frequency_penalty": 2.0}, {"temperature": 2},
        {"stop": None}, {"stop_token_ids": None}, {"stop": ()},
    ],
)
def test_boundaries_accepted(kwargs: dict[str, object]) -> None:
    SamplingParams(**kwargs)  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(
    temperature=st.floats(allow_nan=True, allow_infinity=True),
    top_p=st.floats(allow_nan=True, allow_infinity=True),
    n=st.integers(-5, 40),
)
def test_accepts_exactly_the_documented_ranges(temperature: float, top_p: float, n: int) -> None:
    ok = (
        math.isfinite(temperature) and temperature >= 0
        and math.isfinite(top_p) and 0 < top_p <= 1 and 1 <= n <= MAX_N
    )
    try:
        SamplingParams(temperature=temperature, top_p=top_p, n=n)
    except SamplingParamsError:
        assert not ok
    else:
        assert ok
