"""The contract every audit target meets: describe itself, name its geometry, run requests."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from splitphase.audit.trace import ProbeRequest, RequestTrace
from splitphase.model.config import ModelConfig
from splitphase.model.tokenizer import Tokenizer

# The pluggable piece of in-process targets: run one batch of equal-length prompts for
# `max_tokens` tokens each (greedy, no early stop) and time every token.
GenerateTimed = Callable[[list[list[int]], int], list[RequestTrace]]


class Codec(Protocol):
    """Text <-> token ids, as the target's own tokenizer does it."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class Target(Protocol):
    """An inference stack the audit can probe."""

    def describe(self) -> dict[str, Any]:
        """JSON-ready facts about the target (kind, model, runner, concurrent_streams, ...)."""
        ...

    def model_config(self) -> ModelConfig:
        """The model geometry the FLOP/byte model uses."""
        ...

    def codec(self) -> Codec:
        """The tokenizer probe prompts are built with."""
        ...

    def run(self, requests: Sequence[ProbeRequest], concurrency: int) -> list[RequestTrace]:
        """Run `requests` with at most `concurrency` in flight; one trace each, in order."""
        ...

    def close(self) -> None:
        """Release clients, threads or models."""
        ...


class TokenizerCodec:
    """Our `Tokenizer` (or any tokenizer.json) as a `Codec`."""

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids)
