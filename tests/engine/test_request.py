"""Request: validation, token views, status, and timing from caller-supplied times."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitphase.engine.request import Request, RequestError, RequestStatus
from splitphase.engine.sampling_params import SamplingParams


def test_status_is_finished_and_reasons() -> None:
    finished = {
        RequestStatus.FINISHED_STOPPED: "stop",
        RequestStatus.FINISHED_LENGTH: "length",
        RequestStatus.FINISHED_ABORTED: "abort",
        RequestStatus.FINISHED_ERROR: "error",
    }
    for status in RequestStatus:
        assert status.is_finished() == (status in finished)
        assert RequestStatus.is_finished(status) == (status in finished)
        assert status.finish_reason == finished.get(status)


def test_token_views() -> None:
    r = Request("a", (5, 6, 7))
    assert r.prompt_token_ids == [5, 6, 7] and r.status is RequestStatus.WAITING
    assert r.num_prompt_tokens == 3 and r.num_output_tokens == 0 and r.num_tokens == 3
    assert r.prefill_len == 3 and r.is_prefilling
    r.append_output_token(8, now_s=1.0)
    r.append_output_token(9, now_s=2.0)
    assert r.all_token_ids == [5, 6, 7, 8, 9] and r.num_tokens == 5
    r.all_token_ids.append(1)  # a fresh list each time
    assert r.num_tokens == 5
    assert r.get_token_ids(0, 5) == [5, 6, 7, 8, 9]
    assert r.get_token_ids(2, 4) == [7, 8] and r.get_token_ids(3, 5) == [8, 9]
    assert r.get_token_ids(1, 1) == []
    with pytest.raises(IndexError):
        r.get_token_ids(0, 6)


@given(st.lists(st.integers(0, 9), min_size=1, max_size=8),
       st.lists(st.integers(0, 9), max_size=8), st.data())
@settings(max_examples=60, deadline=None)
def test_get_token_ids_matches_slicing(
    prompt: list[int], out: list[int], data: st.DataObject
) -> None:
    r = Request("a", prompt, output_token_ids=out)
    start = data.draw(st.integers(0, r.num_tokens))
    end = data.draw(st.integers(start, r.num_tokens))
    assert r.get_token_ids(start, end) == (prompt + out)[start:end]


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"request_id": "", "prompt_token_ids": [1]}, "request_id"),
        ({"request_id": 3, "prompt_token_ids": [1]}, "request_id"),
        ({"request_id": "a", "prompt_token_ids": []}, ">= 1 token"),
        ({"request_id": "a", "prompt_token_ids": [1, -2]}, "integers >= 0"),
        ({"request_id": "a", "prompt_token_ids": [True]}, "integers >= 0"),
        ({"request_id": "a", "prompt_token_ids": [1.0]}, "integers >= 0"),
        ({"request_id": "a", "prompt_token_ids": [1], "arrival_time_s": float("nan")}, "finite"),
        ({"request_id": "a", "prompt_token_ids": [1], "eos_token_id": -1}, "eos_token_id"),
        ({"request_id": "a", "prompt_token_ids": [1], "sampling_params": {}}, "SamplingParams"),
    ],
)
def test_bad_requests(kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(RequestError, match=fragment):
        Request(**kwargs)  # type: ignore[arg-type]


def test_timing_from_caller_times() -> None:
    r = Request("a", [1, 2], arrival_time_s=10.0)
    assert r.queue_s is None and r.ttft_s is None and r.tpot_s is None and r.decode_s is None
    assert r.inter_token_s == []
    r.record_scheduled(10.5)
    r.record_scheduled(11.0)  # a re-admission after preemption keeps the first
    r.append_output_token(3, 12.0)
    assert r.queue_s == 0.5 and r.prefill_s == 1.5 and r.ttft_s == 2.0
    assert r.decode_s == 0.0 and r.tpot_s is None
    r.append_output_token(4, 12.25)
    r.append_output_token(5, 13.0)
    assert r.token_times_s == [12.0, 12.25, 13.0]
    assert r.inter_token_s == [0.25, 0.75]
    assert r.decode_s == 1.0 and r.tpot_s == 0.5
    r.finish(RequestStatus.FINISHED_LENGTH, 13.0)
    assert r.is_finished and r.finish_reason == "length" and r.finished_s == 13.0


def test_finish_needs_a_terminal_status_and_tokens_are_checked() -> None:
    r = Request("a", [1])
    with pytest.raises(RequestError):
        r.finish(RequestStatus.RUNNING)
    with pytest.raises(RequestError):
        r.append_output_token(-1, 0.0)
    with pytest.raises(RequestError):
        r.append_output_token(1, float("inf"))


def test_identity_equality_and_default_params() -> None:
    a, b = Request("a", [1]), Request("a", [1])
    assert a != b and a == a
    assert a.sampling_params == SamplingParams()
