"""Incremental, UTF-8-safe detokenization with stop strings matched across token boundaries.

Byte-level BPE tokens can end in the middle of a multi-byte character; the incremental UTF-8
decoder keeps such partial bytes until the character completes, so a delta never carries a
broken character. Stop strings can span several tokens: the last `max_stop_len - 1`
characters are held back until they can no longer begin a stop string, and the stop string
itself is never emitted (OpenAI semantics).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Protocol


class TokenBytes(Protocol):
    def token_bytes(self, token_id: int) -> bytes: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def special_tokens(self) -> dict[str, int]: ...


class IncrementalDetokenizer:
    """Feeds token ids in, hands out text deltas; `stopped` once a stop string appears."""

    def __init__(
        self, tokenizer: TokenBytes, stop: Sequence[str] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tok = tokenizer
        self._stop = tuple(stop)
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self._special = set(tokenizer.special_tokens.values()) if skip_special_tokens else set()
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""  # everything decoded so far (complete characters only)
        self._emitted = 0  # characters of `text` already handed out
        self.stopped = False
        self.stop_reason: str | None = None

    @property
    def output_text(self) -> str:
        """The text handed out so far."""
        return self.text[: self._emitted]

    def _scan_for_stop(self, start: int) -> int | None:
        hits = [i for s in self._stop if (i := self.text.find(s, start)) != -1]
        return min(hits) if hits else None

    def add_token(self, token_id: int) -> str:
        """Append one token; return the new text that is safe to emit."""
        if self.stopped:
            return ""
        # Models often pad their vocabulary past the tokenizer's; a padding id has no text.
        known = 0 <= token_id < self._tok.vocab_size and token_id not in self._special
        raw = self._tok.token_bytes(token_id) if known else b""
        prev_len = len(self.text)
        self.text += self._decoder.decode(raw, final=False)
        if self._stop:
            hit = self._scan_for_stop(max(0, prev_len - self._holdback))
            if hit is not None:
                stop_str = next(s for s in self._stop if self.text.startswith(s, hit))
                self.text = self.text[:hit]
                self.stopped, self.stop_reason = True, stop_str
                return self._emit(len(self.text))
        return self._emit(len(self.text) - self._holdback)

    def flush(self) -> str:
        """The request ended for another reason: release held-back text and partial bytes."""
        if not self.stopped:
            self.text += self._decoder.decode(b"", final=True)
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        upto = max(upto, self._emitted)
        delta = self.text[self._emitted : upto]
        self._emitted = upto
        return delta
