"""Byte-level BPE tokenizer: a thin wrapper over Hugging Face `tokenizers` plus raw token bytes.

Byte-level means every string, any Unicode, maps to tokens and back exactly: the alphabet is
all 256 bytes and there is no normalizer. `token_bytes` gives the raw bytes of one token, which
is what a UTF-8-safe incremental detokenizer needs (a token may end mid-character).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from functools import lru_cache
from importlib import resources
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from splitphase.errors import UserError

ENDOFTEXT = "<|endoftext|>"
# Order fixes the ids: <|endoftext|> is id 0 (bos, eos and document separator).
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
_EOS_CANDIDATES = (ENDOFTEXT, "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>")
_BOS_CANDIDATES = (ENDOFTEXT, "<s>", "<bos>", "<|begin_of_text|>")


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable stand-in character -> byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    # Bytes without a printable glyph are shifted to code points 256, 257, ... in byte order.
    others = [b for b in range(256) if b not in table.values()]
    table.update({chr(256 + n): b for n, b in enumerate(others)})
    return table


def byte_level_chars() -> dict[str, int]:
    """GPT-2 byte-level alphabet: stand-in character -> byte value (256 entries)."""
    return dict(_byte_decoder())


class Tokenizer:
    """Encode/decode text; wraps one `tokenizers.Tokenizer` loaded from a tokenizer.json."""

    def __init__(self, inner: HFTokenizer, bos_token: str | None = None,
                 eos_token: str | None = None) -> None:
        self._inner = inner
        # A second copy that treats "<|user|>" in user text as plain text, so text can never
        # inject special tokens; parse_special=True opts in (chat templates).
        self._literal = HFTokenizer.from_str(inner.to_str())
        self._literal.encode_special_tokens = True
        self._special = [t.content for t in inner.get_added_tokens_decoder().values() if t.special]
        self._bos_id = self._find_id((bos_token,) if bos_token else _BOS_CANDIDATES)
        self._eos_id = self._find_id((eos_token,) if eos_token else _EOS_CANDIDATES)
        self._bytes = self._build_token_bytes()

    def _find_id(self, candidates: Sequence[str]) -> int | None:
        """First candidate token present in the vocabulary."""
        for tok in candidates:
            idx = self._inner.token_to_id(tok)
            if idx is not None:
                return idx
        return None

    def _build_token_bytes(self) -> list[bytes]:
        """Raw bytes per id: byte-level tokens map char-by-char; others fall back to decode."""
        table = _byte_decoder()
        decoder = json.loads(self._inner.to_str()).get("decoder") or {}
        byte_level = decoder.get("type") == "ByteLevel"
        added = {i: t.content for i, t in self._inner.get_added_tokens_decoder().items()}
        out = []
        for idx in range(self.vocab_size):
            piece = self._inner.id_to_token(idx)
            if idx in added or piece is None:
                out.append((added.get(idx) or "").encode("utf-8"))
            elif byte_level and all(ch in table for ch in piece):
                out.append(bytes(table[ch] for ch in piece))
            else:
                out.append(self._inner.decode([idx], skip_special_tokens=False).encode("utf-8"))
        return out

    @property
    def max_token_chars(self) -> int | None:
        """The most input characters one token can cover (its bytes: a character is at least
        one); None when a normalizer may shrink the text first, so that no such bound holds."""
        if self._inner.normalizer is not None:
            return None
        return max((len(b) for b in self._bytes), default=1)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return int(self._inner.get_vocab_size(with_added_tokens=True))

    @property
    def bos_token_id(self) -> int | None:
        """Id prepended by `encode(add_bos=True)`; `<|endoftext|>` for the shipped tokenizer."""
        return self._bos_id

    @property
    def eos_token_id(self) -> int | None:
        """Id that ends a sequence; `<|endoftext|>` for the shipped tokenizer."""
        return self._eos_id

    @property
    def special_tokens(self) -> dict[str, int]:
        """Special token string -> id."""
        ids = {tok: self._inner.token_to_id(tok) for tok in self._special}
        return {tok: int(i) for tok, i in ids.items() if i is not None}

    @property
    def hf(self) -> HFTokenizer:
        """The wrapped `tokenizers.Tokenizer` (for offsets, batching, and so on)."""
        return self._inner

    def encode(self, text: str, add_bos: bool = False, parse_special: bool = False) -> list[int]:
        """Text -> ids; special-token strings in `text` stay plain text unless parse_special."""
        inner = self._inner if parse_special else self._literal
        check_unicode(text)
        if len(text) > RELEASE_GIL_CHARS:
            # `encode` holds the GIL for the whole call (seconds for megabytes, every other
            # thread frozen); `encode_batch` releases it and gives the same ids.
            ids: list[int] = inner.encode_batch([text], add_special_tokens=False)[0].ids
        else:
            ids = inner.encode(text, add_special_tokens=False).ids
        if add_bos:
            if self._bos_id is None:
                raise ValueError("this tokenizer has no bos token; call encode(add_bos=False)")
            ids = [self._bos_id, *ids]
        return ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encode many texts in parallel (special-token strings stay plain text)."""
        return [e.ids for e in self._literal.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Ids -> text; exact inverse of `encode` for the shipped tokenizer."""
        return str(self._inner.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes of one token (may be a partial UTF-8 sequence)."""
        if not 0 <= token_id < len(self._bytes):
            raise ValueError(f"token id {token_id} out of range [0, {len(self._bytes)})")
        return self._bytes[token_id]

    def decode_bytes(self, ids: Iterable[int], skip_special_tokens: bool = True) -> bytes:
        """Concatenated raw bytes of `ids`."""
        special = set(self.special_tokens.values()) if skip_special_tokens else set()
        return b"".join(self.token_bytes(i) for i in ids if i not in special)

    def to_str(self) -> str:
        """The tokenizer.json text."""
        return str(self._inner.to_str())

    def sha256(self) -> str:
        """Hash of the tokenizer.json text: ties data shards and checkpoints to one tokenizer."""
        return hashlib.sha256(self.to_str().encode("utf-8")).hexdigest()

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write a Hugging Face compatible tokenizer.json."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._inner.save(str(path), pretty=True)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load any Hugging Face tokenizer.json."""
        return cls(HFTokenizer.from_file(str(path)))

    @classmethod
    def from_pretrained_dir(cls, model_dir: str | os.PathLike[str]) -> Tokenizer:
        """Load tokenizer.json from a HF model dir, taking bos/eos from tokenizer_config.json."""
        root = Path(model_dir)
        path = root / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found; a model dir needs a tokenizer.json")
        config_path = root / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        return cls(HFTokenizer.from_file(str(path)), _token_str(config.get("bos_token")),
                   _token_str(config.get("eos_token")))

    @classmethod
    def default(cls) -> Tokenizer:
        """The shipped tokenizer (assets/tokenizer.json, trained on the train split)."""
        text = resources.files("splitphase").joinpath("assets/tokenizer.json").read_text("utf-8")
        return cls(HFTokenizer.from_str(text))


RELEASE_GIL_CHARS = 8192  # longer texts are encoded without holding the GIL


def check_unicode(text: str) -> None:
    """UserError for text that is not valid Unicode (a lone UTF-16 surrogate, as JSON allows)."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UserError(
            f"the text holds a lone UTF-16 surrogate ({text[exc.start]!r} at character "
            f"{exc.start}); send valid Unicode (pair the surrogates or drop them)"
        ) from None


def _token_str(value: object) -> str | None:
    """tokenizer_config.json stores a token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096) -> Tokenizer:
    """Train a byte-level BPE tokenizer (deterministic for the same texts in the same order)."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size {vocab_size} must be >= {256 + len(SPECIAL_TOKENS)} "
                         "(256 bytes plus the special tokens)")
    inner = HFTokenizer(models.BPE())
    # add_prefix_space=False and no normalizer: decode(encode(s)) == s for every string.
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    inner.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    inner.train_from_iterator(list(texts), trainer=trainer)
    return Tokenizer(inner)
