"""The load generator's checks can fail: cut, half-written or unterminated streams are lost."""

from __future__ import annotations

import pytest

from splitphase.reliability.loadgen import (
    Outcome,
    _apply,
    arrival_times,
    parse_sse,
    peak_concurrency,
    percentile,
)

CHUNK = b'data: {"choices": [{"index": 0, "text": "hi", "finish_reason": null}]}\n\n'
LAST = b'data: {"choices": [{"index": 0, "text": "!", "finish_reason": "length"}]}\n\n'
ERROR = b'data: {"error": {"message": "m", "type": "t", "param": null, "code": "x"}}\n\n'
DONE = b"data: [DONE]\n\n"


def _outcome(raw: bytes, status: int = 200) -> Outcome:
    out = Outcome(status=status)
    _apply(parse_sse(raw, out), out)
    return out


def test_a_whole_stream_is_completed() -> None:
    out = _outcome(CHUNK + LAST + DONE)
    assert out.completed and not out.lost and out.text == "hi!" and out.events == 2


def test_an_error_event_then_done_is_explicit() -> None:
    out = _outcome(CHUNK + ERROR + DONE)
    assert out.explicit_error and not out.completed and not out.lost and out.error_code == "x"


@pytest.mark.parametrize("raw, why", [
    (CHUNK + LAST, "no [DONE]"),
    (CHUNK + LAST + DONE[:-1], "cut mid-event"),
    (CHUNK + LAST[:30] + b"\n\n" + DONE, "half-written JSON"),
    (CHUNK + DONE + CHUNK, "events after [DONE]"),
    (b"event: x\n\n" + DONE, "not a data line"),
    (CHUNK + DONE, "no finish reason"),
])
def test_broken_streams_are_lost(raw: bytes, why: str) -> None:
    assert _outcome(raw).lost, why


def test_refusals_and_server_errors() -> None:
    assert Outcome(status=429).refused and not Outcome(status=429).lost
    assert Outcome(status=503).refused
    assert Outcome(status=500).lost and Outcome(status=0).lost


def test_arrivals_are_open_loop_and_seeded() -> None:
    even = arrival_times(5, 10.0, poisson=False)
    assert even == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])
    poisson = arrival_times(2000, 100.0, seed=3)
    assert poisson == arrival_times(2000, 100.0, seed=3) != arrival_times(2000, 100.0, seed=4)
    assert poisson[-1] / 2000 == pytest.approx(0.01, rel=0.1)  # mean gap 1/rate
    with pytest.raises(ValueError):
        arrival_times(0, 1.0)


def test_percentile_and_peak_concurrency() -> None:
    assert percentile([], 0.5) is None
    assert percentile(list(range(1, 101)), 0.99) == 99 and percentile([3, 1, 2], 0.5) == 2
    spans = [(0.0, 2.0), (1.0, 3.0), (1.5, 1.7), (2.5, 4.0)]
    assert peak_concurrency([Outcome(sent_s=a, ended_s=b) for a, b in spans]) == 3
