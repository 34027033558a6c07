"""`hf:PATH`: a local Hugging Face causal LM run with transformers `generate`, timed per token.

A `LogitsProcessor` that only reads the clock is called once per generated token, right after
the forward pass that produced it, so its first call marks the end of prefill (time to first
token) and every later call one decode step. Equal-length prompts run batched, as builtin does.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from splitphase.audit.targets.base import Codec, TokenizerCodec
from splitphase.audit.targets.builtin import run_batched
from splitphase.audit.trace import ProbeRequest, RequestTrace
from splitphase.errors import UserError
from splitphase.model.config import ModelConfig
from splitphase.model.tokenizer import Tokenizer


class _HFCodec:
    """transformers' AutoTokenizer, for model dirs without a tokenizer.json."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))




def _load_codec(path: Path) -> Codec:
    if (path / "tokenizer.json").is_file():
        return TokenizerCodec(Tokenizer.from_pretrained_dir(path))
    from transformers import AutoTokenizer

    try:
        return _HFCodec(AutoTokenizer.from_pretrained(str(path), local_files_only=True))
    except (OSError, ValueError) as exc:
        raise UserError(f"hf:{path}: no usable tokenizer ({exc}); add a tokenizer.json") from exc


class HFTarget:
    """A local transformers causal LM directory."""

    def __init__(self, path: str, model_config: ModelConfig | None = None) -> None:
        self.path = Path(path).expanduser()
        if not (self.path / "config.json").is_file():
            raise UserError(f"hf:{path}: no config.json there; give a Hugging Face model directory")
        self._cfg = model_config or ModelConfig.from_hf_config(self.path)
        from transformers import AutoModelForCausalLM

        try:
            self._model = AutoModelForCausalLM.from_pretrained(
                str(self.path), local_files_only=True
            ).eval()
        except (OSError, ValueError, KeyError) as exc:
            raise UserError(f"hf:{path}: transformers cannot load it: {exc}") from exc
        self._codec = _load_codec(self.path)

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "hf",
            "spec": f"hf:{self.path}",
            "model": str(self.path),
            "runner": "transformers generate (greedy, per-token LogitsProcessor timestamps)",
            "device": str(self._model.device),
            "dtype": str(self._model.dtype).removeprefix("torch."),
            "torch_threads": torch.get_num_threads(),
            "concurrent_streams": False,
            "server_metrics": False,
        }

    def model_config(self) -> ModelConfig:
        return self._cfg

    def codec(self) -> Codec:
        return self._codec

    @torch.inference_mode()
    def _generate_timed(self, prompt_ids: list[list[int]], max_tokens: int) -> list[RequestTrace]:
        from transformers import LogitsProcessor, LogitsProcessorList

        stamps: list[float] = []

        class _Stamp(LogitsProcessor):
            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
                stamps.append(time.perf_counter())
                return scores

        ids = torch.tensor(prompt_ids, dtype=torch.long, device=self._model.device)  # (B, N)
        pad = self._model.generation_config.pad_token_id
        send_s = time.perf_counter()
        self._model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,  # ignore EOS: every request decodes the same length
            do_sample=False,
            logits_processor=LogitsProcessorList([_Stamp()]),
            pad_token_id=pad if pad is not None else 0,
        )
        end_s = time.perf_counter()
        n = len(prompt_ids[0])
        return [
            RequestTrace(n, len(stamps), send_s, stamps[0] if stamps else None, list(stamps), end_s)
            for _ in prompt_ids
        ]

    def run(self, requests: Sequence[ProbeRequest], concurrency: int) -> list[RequestTrace]:
        return run_batched(self._generate_timed, requests, concurrency)

    def close(self) -> None:
        pass
