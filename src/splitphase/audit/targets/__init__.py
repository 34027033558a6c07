"""Audit targets: `builtin[:MODEL]`, `hf:PATH`, `openai:URL`, behind one `Target` protocol."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from splitphase.audit.targets.base import Codec, GenerateTimed, Target, TokenizerCodec
from splitphase.audit.trace import ProbeRequest, RequestTrace
from splitphase.errors import UserError
from splitphase.model.config import ModelConfig

KINDS = ("builtin", "hf", "openai")

__all__ = ["Codec", "GenerateTimed", "Target", "TokenizerCodec", "open_target", "KINDS"]


def open_target(
    spec: str, model_config: ModelConfig | None = None, kv_cache_dtype: str = "auto"
) -> Target:
    """Open a target from its spec; `model_config` overrides the geometry it would report.
    `kv_cache_dtype` is the target's K/V cache: a builtin target's engine stores its pool so;
    an openai: server's is only declared (the audit prices its decode bytes at that width)."""
    kind, _, arg = spec.partition(":")
    kind = kind.strip().lower()
    if kv_cache_dtype != "auto" and kind == "hf":
        raise UserError("--kv-cache-dtype: an hf: target keeps K/V in transformers' cache, at the "
                        "model's dtype; the option is for builtin and openai: targets")
    if kind == "builtin":
        from splitphase.audit.targets.builtin import DEFAULT_MODEL, BuiltinTarget

        target: Target = BuiltinTarget(arg or DEFAULT_MODEL, kv_cache_dtype=kv_cache_dtype)
    elif kind == "hf":
        if not arg:
            raise UserError("hf: target needs a model directory, e.g. hf:./my-llama")
        from splitphase.audit.targets.hf import HFTarget

        return HFTarget(arg, model_config)
    elif kind == "openai":
        from splitphase.audit.targets.openai import OpenAITarget

        return OpenAITarget(arg, model_config)
    else:
        raise UserError(f"unknown target {spec!r}; use builtin[:MODEL], hf:PATH or openai:URL")
    if model_config is not None:
        return _WithConfig(target, model_config)
    return target


class _WithConfig:
    """A target whose geometry the user named explicitly (--model-config)."""

    def __init__(self, inner: Target, cfg: ModelConfig) -> None:
        self._inner, self._cfg = inner, cfg

    def describe(self) -> dict[str, Any]:
        return {**self._inner.describe(), "model_config_override": self._cfg.name}

    def model_config(self) -> ModelConfig:
        return self._cfg

    def codec(self) -> Codec:
        return self._inner.codec()

    def run(self, requests: Sequence[ProbeRequest], concurrency: int) -> list[RequestTrace]:
        return self._inner.run(requests, concurrency)

    def close(self) -> None:
        self._inner.close()
