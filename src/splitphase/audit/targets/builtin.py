"""`builtin[:MODEL]`: our model in-process, on the paged engine with continuous batching.

The default run is closed-loop: `concurrency` requests in flight, the next one added as soon as
one finishes, requests with a start offset (the prefill-interference probe) added when their
time comes, so the engine really interleaves prefill with running streams
(`concurrent_streams: True`). Each token is timestamped when its step returns; the engine's own
per-request queue and prefill times are recorded as the server-side values. A custom
`GenerateTimed` runner (e.g. `reference_runner`, the plain model without a scheduler) can be
passed instead.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from itertools import groupby
from typing import Any

import torch

from splitphase.audit.targets.base import Codec, GenerateTimed, TokenizerCodec
from splitphase.audit.trace import ProbeRequest, RequestTrace
from splitphase.engine.config import EngineConfig
from splitphase.engine.llm_engine import LLMEngine, RequestOutput
from splitphase.engine.sampling_params import SamplingParams
from splitphase.errors import UserError
from splitphase.model.checkpoint import load_model, load_tokenizer
from splitphase.model.config import ModelConfig
from splitphase.model.transformer import Transformer

DEFAULT_MODEL = "small"


def reference_runner(model: Transformer) -> GenerateTimed:
    """A `GenerateTimed` over the reference model: one batched prefill, then decode steps."""

    @torch.inference_mode()
    def generate_timed(prompt_ids: list[list[int]], max_tokens: int) -> list[RequestTrace]:
        lengths = {len(p) for p in prompt_ids}
        if len(lengths) != 1 or max_tokens < 1:
            raise ValueError("reference_runner batches equal-length prompts and max_tokens >= 1")
        n = lengths.pop()
        if n + max_tokens > model.cfg.max_seq_len:
            raise UserError(
                f"prompt ({n}) + output ({max_tokens}) tokens exceed the model's context of "
                f"{model.cfg.max_seq_len}; use shorter prompts in the workload"
            )
        ids = torch.tensor(prompt_ids, dtype=torch.long, device=model.device)  # (B, N)
        cache = model.new_cache(len(prompt_ids), n + max_tokens)
        send_s = time.perf_counter()
        logits, _ = model.prefill(ids, cache)  # (B, V)
        tokens = logits.argmax(-1)  # (B,)
        int(tokens[0])  # reading a value waits for the device, so the timestamp is honest
        times = [time.perf_counter()]
        for _ in range(max_tokens - 1):
            tokens = model.decode_step(tokens, cache).argmax(-1)  # (B,)
            int(tokens[0])
            times.append(time.perf_counter())
        return [
            RequestTrace(n, max_tokens, send_s, times[0], list(times), times[-1])
            for _ in prompt_ids
        ]

    return generate_timed


def _shape(request: ProbeRequest) -> tuple[int, int]:
    return request.prompt_tokens, request.output_tokens


def run_batched(
    runner: GenerateTimed, requests: Sequence[ProbeRequest], concurrency: int
) -> list[RequestTrace]:
    """Run consecutive requests of equal shape in batches of up to `concurrency`, in order."""
    traces: list[RequestTrace] = []
    for _, group_iter in groupby(requests, key=_shape):
        group = list(group_iter)
        for start in range(0, len(group), max(1, concurrency)):
            batch = group[start : start + max(1, concurrency)]
            out = runner([list(r.prompt_ids) for r in batch], batch[0].output_tokens)
            for req, trace in zip(batch, out, strict=True):
                trace.point, trace.concurrency, trace.role = req.point, req.concurrency, req.role
                traces.append(trace)
    return traces


def _trace(req: ProbeRequest, send_s: float) -> RequestTrace:
    return RequestTrace(
        req.prompt_tokens,
        req.output_tokens,
        send_s,
        point=req.point,
        concurrency=req.concurrency,
        role=req.role,
    )


def _record(trace: RequestTrace, out: RequestOutput, now_s: float) -> None:
    new = len(out.token_ids) - len(trace.token_times_s)
    trace.token_times_s.extend([now_s] * new)
    if trace.first_token_s is None and trace.token_times_s:
        trace.first_token_s = trace.token_times_s[0]
    if out.finished:
        trace.end_s = now_s
        req = out.request
        if req is not None:
            trace.server_queue_s, trace.server_prefill_s = req.queue_s, req.prefill_s
            trace.preemptions = req.num_preemptions
        if out.finish_reason in ("error", "abort"):
            trace.error = f"finished with {out.finish_reason}"


@torch.inference_mode()
def run_on_engine(
    engine: LLMEngine, requests: Sequence[ProbeRequest], concurrency: int
) -> list[RequestTrace]:
    """Closed loop over the engine: keep `concurrency` requests in flight, honour start offsets."""
    pending = sorted(range(len(requests)), key=lambda i: requests[i].start_offset_s)
    traces: dict[int, RequestTrace] = {}
    live: dict[str, int] = {}
    t0 = time.perf_counter()
    while pending or live:
        now = time.perf_counter()
        while (
            pending
            and len(live) < max(1, concurrency)
            and (requests[pending[0]].start_offset_s <= now - t0 or not live)
        ):
            i = pending.pop(0)
            req = requests[i]
            params = SamplingParams(max_tokens=req.output_tokens, temperature=0, ignore_eos=True)
            live[engine.add_request(list(req.prompt_ids), params, arrival_s=now)] = i
            traces[i] = _trace(req, now)
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.request_id in live:
                _record(traces[live[out.request_id]], out, now)
                if out.finished:
                    del live[out.request_id]
    return [traces[i] for i in range(len(requests))]


MAX_NUM_SEQS = 64  # as `splitphase serve`'s default


class BuiltinTarget:
    """Our model in-process (an embedded name or a checkpoint directory)."""

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        runner: GenerateTimed | None = None,
        policy: str = "chunked",
        max_num_batched_tokens: int = 2048,
        kv_cache_dtype: str = "auto",
    ) -> None:
        self.model_name = model
        self._model = load_model(model)
        self._tok = load_tokenizer(model)
        if self._tok.vocab_size > self._model.cfg.vocab_size:
            raise UserError(
                f"the tokenizer has {self._tok.vocab_size} ids but model {model!r} only "
                f"{self._model.cfg.vocab_size}; put the model's tokenizer.json in its directory"
            )
        self._runner = runner
        self._engine: Any = None
        if runner is None and policy == "disaggregated":
            from splitphase.engine.disagg import DisaggregatedEngine

            # Two worker processes; their K/V crosses torch.distributed like on two hosts.
            self._engine = DisaggregatedEngine.launch(
                model, max_num_seqs=MAX_NUM_SEQS,
                max_num_batched_tokens=max_num_batched_tokens,
                kv_cache_dtype=kv_cache_dtype)
        elif runner is None:
            self._engine = LLMEngine(self._model, self._tok, EngineConfig(
                policy=policy, max_num_seqs=MAX_NUM_SEQS,
                max_num_batched_tokens=max_num_batched_tokens,
                kv_cache_dtype=kv_cache_dtype))
        self.policy = policy
        # A custom runner keeps K/V at the model's dtype (the reference model's own cache).
        use_pool = runner is None and kv_cache_dtype != "auto"
        self.kv_cache_dtype = kv_cache_dtype if use_pool else self._model.cfg.dtype
        self._runner_name = "custom" if runner else f"engine (policy {policy})"
        self._preemptions = 0

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "builtin",
            "spec": f"builtin:{self.model_name}",
            "model": self.model_name,
            "runner": self._runner_name,
            "device": str(self._model.device),
            "dtype": self._model.cfg.dtype,
            "torch_threads": torch.get_num_threads(),
            "concurrent_streams": self._engine is not None,
            "policy": self.policy if self._engine is not None else None,
            "kv_cache_dtype": self.kv_cache_dtype,
            "kv_pool_tokens": self._pool_tokens(),
            "max_num_seqs": MAX_NUM_SEQS if self._engine is not None else None,
            "preemptions": self._preemptions if self._engine is not None else None,
            "server_metrics": False,
        }

    def _pool_tokens(self) -> int | None:
        """Tokens the K/V pool decode runs in holds (a pair's: the decode worker's); None for
        a custom runner, which has none."""
        if self._engine is None:
            return None
        return int(self._engine.kv_pool_blocks * self._engine.kv_block_size)

    def model_config(self) -> ModelConfig:
        return self._model.cfg

    def codec(self) -> Codec:
        return TokenizerCodec(self._tok)

    def run(self, requests: Sequence[ProbeRequest], concurrency: int) -> list[RequestTrace]:
        if self._engine is not None:
            traces = run_on_engine(self._engine, requests, concurrency)
            self._preemptions += sum(t.preemptions for t in traces)
            return traces
        assert self._runner is not None
        return run_batched(self._runner, requests, concurrency)

    def close(self) -> None:
        closer = getattr(self._engine, "close", None)
        if closer is not None:  # the disaggregated pair's worker processes
            closer()
