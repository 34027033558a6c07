"""The stop rules read after each sampled token."""

from __future__ import annotations

from splitphase.engine.request import Request, RequestStatus
from splitphase.engine.sampling_params import SamplingParams
from splitphase.engine.stop import check_stop

EOS, STOPPED, LENGTH = 2, RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH


def sampled(tokens: list[int], eos_token_id: int | None = None, **params: object) -> Request:
    req = Request("r", [5, 6, 7], SamplingParams(**params), eos_token_id=eos_token_id)
    for t in tokens:
        req.append_output_token(t, 0.0)
    return req


def test_eos_stops_and_wins_over_length() -> None:
    assert check_stop(sampled([9]), EOS, 64) is None
    assert check_stop(sampled([9, EOS], max_tokens=2), EOS, 64) is STOPPED  # not "length"
    assert check_stop(sampled([EOS], ignore_eos=True), EOS, 64) is None
    assert check_stop(sampled([EOS]), None, 64) is None  # no EOS known


def test_a_requests_own_eos_replaces_the_models() -> None:
    assert check_stop(sampled([EOS], eos_token_id=4), EOS, 64) is None
    assert check_stop(sampled([4], eos_token_id=4), EOS, 64) is STOPPED


def test_stop_token_ids_and_the_callers_rule_stop() -> None:
    assert check_stop(sampled([8], stop_token_ids=[8]), EOS, 64) is STOPPED
    assert check_stop(sampled([8, 9]), EOS, 64, lambda r: r.num_output_tokens == 2) is STOPPED
    assert check_stop(sampled([8]), EOS, 64, lambda r: r.num_output_tokens == 2) is None


def test_length_is_max_tokens_or_the_models_context() -> None:
    assert check_stop(sampled([8, 9], max_tokens=2), EOS, 64) is LENGTH
    assert check_stop(sampled([8, 9], max_tokens=3), EOS, 5) is LENGTH  # 3 prompt + 2 = 5
    assert check_stop(sampled([8, 9], max_tokens=3), EOS, 6) is None
