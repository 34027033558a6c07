import torch

from splitphase.engine.sampler import (
    SamplingState,
    plain_greedy,
    sample,
    sample_plain_greedy,
    sample_row,
)
from splitphase.engine.sampling_params import SamplingParams


def _state(**kw):
    return SamplingState.create(SamplingParams(**kw), fallback_seed=0)


def test_greedy_is_argmax():
    logits = torch.tensor([0.1, 3.0, 0.2])
    assert sample_row(logits, _state(temperature=0)).token_id == 1


def test_a_tiny_positive_temperature_is_greedy_not_nan():
    """5e-324 (the smallest double) divided the logits into inf and the softmax into NaN,
    failing the engine step for every request in it (found by the OpenAPI fuzz test)."""
    logits = torch.tensor([0.1, 3.0, 0.2, -40.0])
    for t in (5e-324, 1e-30, 1e-6):
        assert sample_row(logits, _state(temperature=t, seed=0)).token_id == 1
    assert not SamplingParams(temperature=1e-4).is_greedy  # small, but still sampled


def test_a_top_p_that_rounds_to_zero_keeps_the_likeliest_token():
    """top_p 5e-324 is 0 in fp32: every token was dropped and the softmax was NaN."""
    logits = torch.tensor([0.1, 3.0, 0.2, -40.0])
    for top_p in (5e-324, 1e-45):
        assert sample_row(logits, _state(temperature=1.0, top_p=top_p, seed=0)).token_id == 1


def test_top_k_one_is_greedy_and_top_p_tiny_is_greedy():
    logits = torch.randn(50)
    best = int(logits.argmax())
    assert all(
        sample_row(logits, _state(temperature=1.0, top_k=1, seed=i)).token_id == best
        for i in range(20)
    )
    assert all(
        sample_row(logits, _state(temperature=1.0, top_p=1e-6, seed=i)).token_id == best
        for i in range(20)
    )


def test_top_p_keeps_the_smallest_set_reaching_it_and_ties_with_its_last_token():
    logits = torch.tensor([0.5, 0.3, 0.1, 0.1, 0.0]).log()

    def picks(top_p: float) -> set[int]:
        return {
            sample_row(logits, _state(temperature=1.0, top_p=top_p, seed=i)).token_id
            for i in range(300)
        }

    assert picks(0.75) == {0, 1}
    assert picks(0.85) == {0, 1, 2, 3}  # token 2 reaches 0.85; token 3 ties with it


def test_min_p_excludes_unlikely_tokens():
    logits = torch.tensor([5.0, 4.9, -10.0, -10.0])
    picks = {
        sample_row(logits, _state(temperature=1.0, min_p=0.5, seed=i)).token_id for i in range(50)
    }
    assert picks <= {0, 1}


def test_seed_reproducible_and_penalties_discourage_repeats():
    logits = torch.zeros(10)
    a = [sample_row(logits, s).token_id for s in [_state(temperature=1.0, seed=7)] * 5]
    b = [sample_row(logits, s).token_id for s in [_state(temperature=1.0, seed=7)] * 5]
    assert a == b
    state = _state(temperature=0, frequency_penalty=2.0)
    first = sample_row(logits, state).token_id
    assert sample_row(logits, state).token_id != first


def test_logprobs_are_raw_log_softmax():
    logits = torch.tensor([1.0, 2.0, 3.0])
    tok = sample_row(logits, _state(temperature=0.5, logprobs=2, seed=1))
    ref = logits.log_softmax(-1)
    assert abs(tok.logprob - float(ref[tok.token_id])) < 1e-6
    assert [t for t, _ in tok.top_logprobs] == [2, 1]


def test_logit_bias_bans_and_forces_tokens_greedy_and_sampled():
    logits = torch.tensor([0.1, 3.0, 0.2, 1.0])
    assert sample_row(logits, _state(temperature=0, logit_bias={1: -100})).token_id == 3
    assert sample_row(logits, _state(temperature=0, logit_bias={1: -1.0})).token_id == 1
    for seed in range(20):  # +100 is exclusive selection under sampling too
        state = _state(temperature=1.0, seed=seed, logit_bias={2: 100})
        assert sample_row(logits, state).token_id == 2


def test_logprobs_ignore_logit_bias():
    logits = torch.tensor([1.0, 2.0, 3.0])
    tok = sample_row(logits, _state(temperature=0, logprobs=1, logit_bias={0: 100}))
    assert tok.token_id == 0
    assert abs(tok.logprob - float(logits.log_softmax(-1)[0])) < 1e-6


def test_plain_greedy_rows_in_one_argmax_equal_row_by_row_and_the_rest_is_left():
    """`sample` takes greedy rows without penalties, logit_bias or logprobs in one argmax: the
    same tokens and recorded counts as `sample_row` one by one; other rows go row by row."""
    torch.manual_seed(0)
    logits = torch.randn(6, 40)
    logits[2, 5] = logits[2, 9] = logits[2].max() + 1  # a tie: the first index wins
    kinds = [dict(temperature=0), dict(temperature=1.0, seed=3), dict(temperature=0),
             dict(temperature=0, logprobs=2), dict(temperature=0, frequency_penalty=1.0),
             dict(temperature=0, logit_bias={7: 50.0})]

    def states() -> list[SamplingState]:
        return [_state(**kw) for kw in kinds]

    batched, single = states(), states()
    assert [plain_greedy(s) for s in batched] == [True, False, True, False, False, False]
    for _ in range(3):
        got = sample(logits, batched)
        want = [sample_row(logits[i], s) for i, s in enumerate(single)]
        assert got == want
    assert got[2].token_id == 5 and got[5].token_id == 7
    assert [s.output_counts for s in batched] == [s.output_counts for s in single]
    assert sample_plain_greedy(logits, {1: batched[1], 3: batched[3]}) == {}
