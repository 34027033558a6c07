"""The pre-rendered chunks are byte for byte what the pydantic models serialize."""

from hypothesis import given
from hypothesis import strategies as st

from splitphase.server.chunks import chat_template, completion_template
from splitphase.server.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
)

# Quotes, backslashes, control characters, non-ASCII, and the templates' own sentinels.
TEXTS = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40) | \
    st.sampled_from(['"', "\\", "\n\t\r\x00\x1f\x7f", "é€😀", "\ue000", "\ue001", "987654321"])
REASONS = st.sampled_from([None, "stop", "length", "abort", "error"])
# Ids and model names may hold anything, the sentinels included.
NAMES = st.sampled_from(["m", "cmpl-1", "a\ue000b", "987654321", 'q"\\uote'])


@given(TEXTS, st.integers(0, 200), REASONS, NAMES)
def test_completion_chunk_equals_pydantic(text: str, index: int, reason: str | None,
                                          model: str) -> None:
    want = CompletionResponse(id="cmpl-x", created=17, model=model, choices=[
        CompletionChoice(index=index, text=text, finish_reason=reason)]).model_dump_json()
    got = completion_template("cmpl-x", 17, model).render(index, text, reason)
    assert got == f"data: {want}\n\n"


@given(TEXTS, st.integers(0, 200), REASONS, NAMES, st.booleans())
def test_chat_chunk_equals_pydantic(text: str, index: int, reason: str | None, model: str,
                                    first: bool) -> None:
    delta = ChatDelta(role="assistant" if first else None, content=text)
    want = ChatCompletionChunk(id="chatcmpl-x", created=3, model=model, choices=[
        ChatChunkChoice(index=index, delta=delta, finish_reason=reason)]).model_dump_json()
    got = chat_template("chatcmpl-x", 3, model, first).render(index, text, reason)
    assert got == f"data: {want}\n\n"
