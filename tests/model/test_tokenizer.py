"""Tokenizer: exact round trips on any Unicode, special tokens, raw bytes, HF files."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitphase.errors import UserError
from splitphase.model.tokenizer import (
    RELEASE_GIL_CHARS,
    SPECIAL_TOKENS,
    Tokenizer,
    train_tokenizer,
)

TOK = Tokenizer.default()
ASTRAL = st.characters(min_codepoint=0x10000, max_codepoint=0x10FFFF, exclude_categories=["Cs"])


@settings(max_examples=300, deadline=None)
@given(st.text() | st.text(alphabet=ASTRAL) | st.text(alphabet="ab \n🎉👩‍👩‍👧𝔘é\u0301<|>"))
def test_round_trip(text: str) -> None:
    ids = TOK.encode(text)
    assert TOK.decode(ids) == text
    assert b"".join(TOK.token_bytes(i) for i in ids) == text.encode("utf-8")
    assert TOK.decode_bytes(ids) == text.encode("utf-8")


@pytest.mark.parametrize("text", ["", "Hamlet.\nTo be, or not", "👩‍👩‍👧 𝔘 \x00\r\n\t  x ",
                                  "<|endoftext|><|user|>"])
def test_round_trip_examples(text: str) -> None:
    assert TOK.decode(TOK.encode(text)) == text


def test_special_tokens() -> None:
    assert TOK.vocab_size == 4096
    assert TOK.special_tokens == {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    assert TOK.eos_token_id == TOK.bos_token_id == 0
    assert TOK.encode("hi", add_bos=True)[0] == 0
    # User text never turns into special ids unless the caller asks for it.
    assert 2 not in TOK.encode("<|user|>hi")
    assert TOK.encode("<|user|>hi", parse_special=True)[0] == 2
    assert TOK.token_bytes(0) == b"<|endoftext|>"
    assert TOK.decode([0, *TOK.encode("hi")]) == "hi"
    with pytest.raises(ValueError, match="out of range"):
        TOK.token_bytes(TOK.vocab_size)


def test_save_and_load_hf_file(tmp_path: Path) -> None:
    path = tmp_path / "model" / "tokenizer.json"
    TOK.save(path)
    loaded = Tokenizer.from_file(path)
    assert loaded.sha256() == TOK.sha256()
    assert loaded.encode("Thou art") == TOK.encode("Thou art")
    assert Tokenizer.from_pretrained_dir(path.parent).eos_token_id == 0


def test_foreign_hf_tokenizer(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as HF
    from tokenizers import models, pre_tokenizers, trainers

    hf = HF(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.train_from_iterator(["hello world"] * 10, trainers.BpeTrainer(
        vocab_size=60, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    tok = Tokenizer.from_pretrained_dir(tmp_path)
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.decode(tok.encode("hello world")) == "hello world"
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_pretrained_dir(tmp_path / "missing")


def test_train_tokenizer_deterministic() -> None:
    texts = ["To be, or not to be, that is the question.\n"] * 20 + ["In the beginning 🎉\n"]
    a, b = train_tokenizer(texts, vocab_size=300), train_tokenizer(texts, vocab_size=300)
    assert a.to_str() == b.to_str()
    assert a.special_tokens["<|endoftext|>"] == 0
    assert a.decode(a.encode("ünïcode 𝔘")) == "ünïcode 𝔘"
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(texts, vocab_size=100)


@pytest.mark.parametrize("text", ["ab\ud800cd", "\udfff", "ok \ud83d"])
def test_lone_surrogates_are_a_user_error_not_a_crash(text: str) -> None:
    # JSON may carry "\ud800"; the Rust tokenizer raised a TypeError on it (a 500 in serve).
    with pytest.raises(UserError, match="surrogate"):
        Tokenizer.default().encode(text)
    with pytest.raises(UserError, match="surrogate"):
        Tokenizer.default().encode(text, parse_special=True)
    assert Tokenizer.default().encode("\ud83d\ude00".encode("utf-16", "surrogatepass")
                                      .decode("utf-16")) != []  # a paired surrogate is fine


def test_long_texts_encode_the_same_without_holding_the_gil() -> None:
    text = "Hello, wörld! <|endoftext|> 你好 " * 40_000  # 1.1 M characters
    assert len(text) > RELEASE_GIL_CHARS
    ids: list[int] = []
    worker = threading.Thread(target=lambda: ids.extend(TOK.encode(text, parse_special=True)))
    ticks = 0
    worker.start()
    while worker.is_alive():  # this thread keeps running while the other one encodes
        time.sleep(0.001)
        ticks += 1
    worker.join()
    assert ids == TOK.hf.encode(text, add_special_tokens=False).ids  # the same ids as encode
    assert TOK.decode(TOK.encode(text)) == text
    assert ticks >= 20, ticks
