from hypothesis import given, settings
from hypothesis import strategies as st

from splitphase.engine.detokenizer import IncrementalDetokenizer


def _stream(tokenizer, text, stop=()):
    detok = IncrementalDetokenizer(tokenizer, stop)
    deltas = [detok.add_token(t) for t in tokenizer.encode(text)]
    deltas.append(detok.flush())
    return detok, deltas


@settings(max_examples=150, deadline=None)
@given(st.text(min_size=0, max_size=40).filter(lambda s: "\ufffd" not in s))
def test_deltas_concatenate_to_text_and_never_break_characters(tokenizer, text):
    _, deltas = _stream(tokenizer, text)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_multibyte_character_split_across_tokens_is_held(tokenizer):
    # Feed the raw UTF-8 bytes of an emoji one byte-token at a time.
    ids = tokenizer.encode("\U0001f600")
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add_token(t) for t in ids]
    assert "".join(deltas) == "\U0001f600" and all(d in ("", "\U0001f600") for d in deltas)


@settings(max_examples=100, deadline=None)
@given(
    st.text(alphabet="abc ", min_size=1, max_size=30),
    st.text(alphabet="abc", min_size=1, max_size=4),
)
def test_stop_string_matched_across_tokens_and_excluded(tokenizer, text, stop):
    detok, deltas = _stream(tokenizer, text, [stop])
    out = "".join(deltas)
    if stop in text:
        assert detok.stopped and out == text[: text.index(stop)]
    else:
        assert not detok.stopped and out == text


def test_ids_past_the_tokenizer_vocabulary_have_no_text(tokenizer):
    # Models often pad their vocabulary beyond the tokenizer's; such ids decode to nothing.
    detok = IncrementalDetokenizer(tokenizer)
    ids = tokenizer.encode("hello world")
    ids.insert(1, tokenizer.vocab_size + 7)
    assert "".join(detok.add_token(t) for t in ids) + detok.flush() == "hello world"
