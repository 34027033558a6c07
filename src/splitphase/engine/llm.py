"""The offline API: `LLM(model="small", policy="chunked").generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from splitphase.engine.config import EngineConfig
from splitphase.engine.disagg import DisaggregatedEngine
from splitphase.engine.engine_client import EngineCoreClient
from splitphase.engine.engine_core import engine_factory
from splitphase.engine.llm_engine import LLMEngine, RequestOutput, StepRecord
from splitphase.engine.sampling_params import SamplingParams
from splitphase.model.checkpoint import load_model, load_tokenizer, read_config, resolve_model_dir
from splitphase.model.tokenizer import Tokenizer
from splitphase.model.transformer import Transformer
from splitphase.training.trainer import pick_device


@dataclass(frozen=True)
class Timings:
    """Per-request phase times in seconds (None where a phase never ran)."""

    queue_s: float | None
    prefill_s: float | None
    ttft_s: float | None
    decode_s: float | None
    tpot_s: float | None
    inter_token_s: tuple[float, ...]


@dataclass(frozen=True)
class Completion:
    """One finished request of an offline batch."""

    prompt: str | list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    timings: Timings
    output: RequestOutput


def timings_of(out: RequestOutput) -> Timings:
    req = out.request
    if req is None:
        return Timings(None, None, None, None, None, ())
    return Timings(
        req.queue_s, req.prefill_s, req.ttft_s, req.decode_s, req.tpot_s, tuple(req.inter_token_s)
    )


class LLM:
    """Load a model once, then run batches of prompts through the engine.

    `policy="disaggregated"` starts a prefill and a decode worker process
    (`splitphase.engine.disagg`): they load the model themselves (an in-memory model goes
    through a temporary checkpoint), so `self.model` is None for a model given by name.
    `engine_process=True` runs the engine in one child process (`engine_core.py`; a server's
    event loop then never holds the GIL the engine needs); it too needs `close()`.
    Call `close()` (or use `with LLM(...) as llm:`) to stop them.
    """

    def __init__(
        self,
        model: str | Transformer = "small",
        tokenizer: Tokenizer | None = None,
        device: str = "auto",
        dtype: str | None = None,
        engine_process: bool = False,
        **engine_kwargs: Any,
    ) -> None:
        known = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(engine_kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine options {unknown}; known: {sorted(known)}")
        self.engine: LLMEngine | DisaggregatedEngine | EngineCoreClient
        self.model: Transformer | None
        self._name = model if isinstance(model, str) else None
        self._dtype = dtype
        if engine_kwargs.get("policy") == "disaggregated":
            self.model = model if isinstance(model, Transformer) else None
            self.engine = DisaggregatedEngine.launch(
                model, tokenizer, str(pick_device(device)), dtype, **engine_kwargs
            )
            self.tokenizer = self.engine.tokenizer
            return
        if engine_process:
            if not isinstance(model, str):
                raise TypeError("engine_process=True loads the model in the child: give its "
                                "name or checkpoint directory, not a Transformer")
            self.model, self.tokenizer = None, tokenizer or load_tokenizer(model)
            self.engine = EngineCoreClient.launch(
                engine_factory(model, str(pick_device(device)), dtype, engine_kwargs),
                self.tokenizer)
            return
        if isinstance(model, str):
            self.model = load_model(model, device=pick_device(device), dtype=dtype)
            self.tokenizer = tokenizer or load_tokenizer(model)
        else:
            self.model, self.tokenizer = model, tokenizer or Tokenizer.default()
        self.engine = LLMEngine(self.model, self.tokenizer, EngineConfig(**engine_kwargs))

    @property
    def steps(self) -> list[StepRecord]:
        return self.engine.steps

    @property
    def dtype(self) -> str:
        """The dtype the model computes in, here or where the engine runs (an engine process
        or a worker pair loads the checkpoint itself, in `dtype` or the checkpoint's own)."""
        if self.model is not None:
            return str(self.model.cfg.dtype)
        if self._dtype is not None or self._name is None:
            return self._dtype or "bfloat16"
        return read_config(resolve_model_dir(self._name))[0].dtype

    def close(self) -> None:
        """Stop the worker or engine core processes (no-op for an in-process engine)."""
        if isinstance(self.engine, DisaggregatedEngine | EngineCoreClient):
            self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[str | list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Run every prompt to completion; results in prompt order (n > 1: samples follow)."""
        plist = (
            list(params)
            if isinstance(params, Sequence)
            else [params or SamplingParams()] * len(prompts)
        )
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        results = []
        for rid, prompt, sp in zip(ids, prompts, plist, strict=True):
            for k in range(sp.n):
                out = done[rid if k == 0 else f"{rid}#{k}"]
                results.append(
                    Completion(
                        prompt, out.text, out.token_ids, out.finish_reason, timings_of(out), out
                    )
                )
        return results
