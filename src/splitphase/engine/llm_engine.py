"""The synchronous engine: scheduler -> model runner -> sampler -> scheduler -> detokenizer.

One `step()` is one forward pass. Each step is timed once, where it runs, and tagged with its
phase and its analytical FLOPs and bytes (`audit.flops.step_cost`); each request keeps its own
queue, prefill, TTFT, inter-token and decode times (`Request`).
"""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass, field, replace

import torch

from splitphase.audit.flops import step_cost
from splitphase.engine.config import EngineConfig
from splitphase.engine.detokenizer import IncrementalDetokenizer
from splitphase.engine.kv_cache import PagedKVCache, kv_cache_torch_dtype, num_blocks_for_budget
from splitphase.engine.model_runner import ModelRunner
from splitphase.engine.request import Request, RequestStatus, validate_prompt
from splitphase.engine.sampler import (
    SampledToken,
    SamplingState,
    prompt_logprobs,
    sample_plain_greedy,
    sample_row,
)
from splitphase.engine.sampling_params import SamplingParams
from splitphase.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from splitphase.errors import UserError
from splitphase.hardware.memory import keep_freed_memory
from splitphase.model import compiled
from splitphase.model.tokenizer import Tokenizer
from splitphase.model.transformer import Transformer


@dataclass
class Handoff:
    """A prefilled request on its way from a prefill engine to a decode engine."""

    request: Request
    k: torch.Tensor  # (L, T, G, D) for positions [0, num_computed_tokens)
    v: torch.Tensor
    generator_state: torch.Tensor  # the sampler's RNG, so seeded outputs match colocated runs
    sent_chars: int
    sent_tokens: int


class StepFailedError(RuntimeError):
    """A step's forward or sampling raised; its requests were ended with an error."""

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"step failed for {len(request_ids)} request(s): {cause!r}")
        self.request_ids, self.cause = request_ids, cause


@dataclass(frozen=True)
class StepRecord:
    """One engine step: its phase mix, wall time and analytical cost."""

    step_id: int
    phase: str
    num_prefill_tokens: int
    num_decode_seqs: int
    wall_s: float
    flops: float
    bytes: float
    # perf_counter at the step's start (comparable within one process): with the next step's
    # start it gives the loop's own cadence, host work between steps included.
    started_s: float = 0.0
    num_preemptions: int = 0  # requests preempted while this step was planned
    prefix_cache_queries_tokens: int = 0  # admissions' prompt tokens looked up in the cache
    prefix_cache_hits_tokens: int = 0  # of those, tokens found computed


@dataclass
class RequestOutput:
    """What a request produced so far; `delta` is the text new since the last output."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    delta: str
    finished: bool
    finish_reason: str | None
    logprobs: list[SampledToken] = field(default_factory=list)
    prompt_logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] | None = None
    request: Request | None = field(default=None, repr=False)


@dataclass
class _Tracked:
    request: Request
    sampling: SamplingState
    detok: IncrementalDetokenizer
    logprobs: list[SampledToken] = field(default_factory=list)
    prompt_logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] | None = None
    fed: int = 0  # output tokens given to the detokenizer
    sent_chars: int = 0  # text already reported
    sent_tokens: int = 0  # tokens already reported


class LLMEngine:
    """Continuous batching over a paged KV cache, one policy per engine."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer, config: EngineConfig) -> None:
        self.model, self.tokenizer, self.config = model, tokenizer, config
        if model.device.type == "cpu":
            keep_freed_memory()  # activations reuse the heap instead of fresh page faults
        cfg = model.cfg
        dtype_bytes = model.embed_tokens.weight.element_size()
        kv_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, model.dtype)
        num_blocks = config.num_blocks or num_blocks_for_budget(
            cfg, config.block_size, kv_dtype.itemsize, config.kv_cache_bytes,
            config.kv_memory_fraction, model.device, config.max_num_seqs, config.max_model_len,
        )
        self.cache = PagedKVCache(cfg, num_blocks, config.block_size, kv_dtype, model.device)
        self.kv_pool_blocks, self.kv_block_size = num_blocks, config.block_size
        self.scheduler = Scheduler(
            SchedulerConfig(
                policy=config.policy,
                role=config.role,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                enable_prefix_caching=config.enable_prefix_caching,
                block_size=config.block_size,
                num_blocks=num_blocks,
                max_model_len=config.resolve_max_model_len(cfg.max_seq_len,
                                                           num_blocks * config.block_size),
                eos_token_id=tokenizer.eos_token_id,
            )
        )
        self.runner = ModelRunner(model, self.cache)
        self.runner.warm_up()
        if config.compile:  # the switch is process-wide: an engine owns its process's model
            compiled.set_enabled(True, config.compile)
        self.dtype_bytes, self.kv_dtype_bytes = dtype_bytes, kv_dtype.itemsize
        self.steps: list[StepRecord] = []
        self._tracked: dict[str, _Tracked] = {}
        # Decode worker: K/V received from the prefill worker, loaded when scheduled.
        self.kv_payloads: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._rng = random.Random(config.seed)
        self._ids = itertools.count()

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

    # ---- requests -------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_s: float | None = None,
        prompt_logprobs: int | None = None,
    ) -> str:
        """Queue a request (text or token ids); returns its id."""
        params = params or SamplingParams()
        ids = (
            self.tokenizer.encode(prompt, add_bos=True) if isinstance(prompt, str) else list(prompt)
        )
        self._check_prompt(ids, params)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self._tracked:
            raise UserError(f"request id {rid!r} is already in use")
        req = Request(rid, ids, params, time.perf_counter() if arrival_s is None else arrival_s)
        # Prompt logprobs need logits at every prompt position: no prefix-cache skipping (vLLM).
        req.use_prefix_cache = prompt_logprobs is None
        self._track(req, params)
        if prompt_logprobs is not None:
            self._tracked[rid].prompt_logprobs = []
        self.scheduler.add_request(req)
        return rid

    def _check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        validate_prompt(ids, params, self.model.cfg.vocab_size, self.max_model_len)

    def _track(self, req: Request, params: SamplingParams, seed_offset: int = 0) -> _Tracked:
        seed = (params.seed + seed_offset) % 2**64 if params.seed is not None else None
        fallback = self._rng.getrandbits(63)
        state = SamplingState.create(params if seed is None else _with_seed(params, seed), fallback)
        detok = IncrementalDetokenizer(self.tokenizer, params.stop)
        t = _Tracked(req, state, detok)
        self._tracked[req.request_id] = t
        return t

    def abort_request(
        self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> None:
        """Abort a request (and its n > 1 siblings) in any state; blocks are freed at once."""
        t = self._tracked.get(request_id)
        children = [c.request_id for c in t.request.children] if t is not None else []
        for rid in [request_id, *children]:
            self.scheduler.abort_request(rid, time.perf_counter(), status)
            self.kv_payloads.pop(rid, None)  # adopted but never loaded: its K/V goes too

    # ---- disaggregation: hand requests from a prefill engine to a decode engine ------------
    def pop_handoffs(self) -> list[Handoff]:
        """Prefill role: requests whose first token is out, with their K/V and sampler state."""
        handoffs = []
        for h in self.scheduler.pop_handoffs():
            rid = h.request.request_id
            t = self._tracked.pop(rid)
            self._feed(t, len(h.request.output_token_ids))
            k, v = self.runner.export_kv(h.block_table, h.num_computed_tokens)
            if h.block_table:
                self.scheduler.release_handoff(rid)
            handoffs.append(
                Handoff(
                    h.request, k, v, t.sampling.generator.get_state(), t.sent_chars, t.sent_tokens
                )
            )
        return handoffs

    def _adopt(self, handoff: Handoff) -> None:
        """Track a request arriving from the other engine, with its sampler and text state."""
        req = handoff.request
        t = self._track(req, req.sampling_params)
        t.sampling.generator.set_state(handoff.generator_state)
        # The penalties count every output token so far, wherever it was sampled.
        t.sampling.output_counts.update(req.output_token_ids)
        self._feed(t, len(req.output_token_ids))
        t.sent_chars, t.sent_tokens = handoff.sent_chars, handoff.sent_tokens

    def add_prefilled(self, handoff: Handoff) -> None:
        """Decode role: adopt a request prefilled elsewhere; its K/V loads when it is scheduled."""
        self._adopt(handoff)
        self.kv_payloads[handoff.request.request_id] = (handoff.k, handoff.v)
        self.scheduler.add_prefilled_request(handoff.request)

    def readmit_preempted(self, handoff: Handoff) -> None:
        """Prefill role: take back a request the decode engine preempted, for a fresh prefill."""
        self._adopt(handoff)
        self.scheduler.add_request(handoff.request)  # recomputes prompt + outputs, samples next

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or any(
            t.sent_tokens < len(t.request.output_token_ids) or not t.request.is_finished
            for t in self._tracked.values()
        )

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run, sample, update; return the outputs of requests that advanced."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule(t0)
        if out.num_seqs:
            want = {c.request_id for c in out.prefill if self._wants_prompt_logprobs(c.request_id)}
            try:
                result = self.runner.execute(out, want, self.kv_payloads)
                sampled = self._sample(out, result.sample_ids, result.logits)
            except Exception as exc:
                raise StepFailedError(self._fail_step(out), exc) from exc
            for rid, logits in result.prompt_logits.items():
                self._record_prompt_logprobs(rid, out, logits)
            now = time.perf_counter()
            self.scheduler.update_from_output(out, sampled, now, self._stop_checker)
            self._adopt_children(out)
            self._record_step(out, t0, now - t0)
        return self._outputs()

    def _fail_step(self, out: SchedulerOutput) -> list[str]:
        """End every request of a failed step with an error and close the step."""
        now = time.perf_counter()
        ids = [c.request_id for c in out.prefill] + list(out.decode.request_ids)
        for rid in ids:
            self.scheduler.abort_request(rid, now, RequestStatus.FINISHED_ERROR)
            self._tracked.pop(rid, None)
        self.scheduler.update_from_output(out, {}, now)  # skips the aborted: clears the step
        return ids

    def _wants_prompt_logprobs(self, rid: str) -> bool:
        t = self._tracked.get(rid)
        return t is not None and t.prompt_logprobs is not None and t.request.num_preemptions == 0

    def _record_prompt_logprobs(self, rid: str, out: SchedulerOutput, logits: torch.Tensor) -> None:
        chunk = next(c for c in out.prefill if c.request_id == rid)
        t = self._tracked[rid]
        targets = t.request.prompt_token_ids[chunk.start + 1 : chunk.end + 1]
        top_n = t.request.sampling_params.logprobs or 0
        if t.prompt_logprobs is not None:
            t.prompt_logprobs.extend(prompt_logprobs(logits[: len(targets)], targets, top_n))

    def _sample(
        self, out: SchedulerOutput, ids: tuple[str, ...], logits: torch.Tensor
    ) -> dict[str, list[int]]:
        n_samples = {c.request_id: c.num_samples for c in out.prefill if c.is_last_chunk}
        sampled: dict[str, list[int]] = {}
        fast = sample_plain_greedy(logits, {i: self._tracked[rid].sampling for i, rid in
                                            enumerate(ids) if n_samples.get(rid, 1) == 1})
        for i, rid in enumerate(ids):
            parent = self._tracked[rid]
            tokens = []
            for k in range(n_samples.get(rid, 1)):
                t = parent if k == 0 else self._child(parent, k)
                tok = fast[i] if i in fast else sample_row(logits[i], t.sampling)
                if t.request.sampling_params.logprobs is not None:
                    t.logprobs.append(tok)
                tokens.append(tok.token_id)
            sampled[rid] = tokens
        return sampled

    def _child(self, parent: _Tracked, k: int) -> _Tracked:
        """Sampler state of the k-th sample of an n > 1 request (the scheduler names it id#k)."""
        rid = f"{parent.request.request_id}#{k}"
        if rid not in self._tracked:
            # Stands in until the scheduler creates the child Request (_adopt_children).
            stand_in = Request(rid, parent.request.prompt_token_ids, parent.request.sampling_params)
            child = self._track(stand_in, parent.request.sampling_params, seed_offset=k)
            child.prompt_logprobs = parent.prompt_logprobs  # one prompt, scored once
        return self._tracked[rid]

    def _adopt_children(self, out: SchedulerOutput) -> None:
        for c in out.prefill:
            t = self._tracked.get(c.request_id)
            for child in t.request.children if t is not None else []:
                if child.request_id in self._tracked:
                    self._tracked[child.request_id].request = child

    def _feed(self, t: _Tracked, upto: int) -> None:
        while t.fed < upto:
            t.detok.add_token(t.request.output_token_ids[t.fed])
            t.fed += 1

    def _stop_checker(self, req: Request) -> bool:
        t = self._tracked[req.request_id]
        t.request = req
        self._feed(t, len(req.output_token_ids))
        return t.detok.stopped

    def _record_step(self, out: SchedulerOutput, started_s: float, wall_s: float) -> None:
        cost = step_cost(
            self.model.cfg,
            [(c.num_tokens, c.start) for c in out.prefill],
            out.decode.positions,
            self.dtype_bytes,
            kv_dtype_bytes=self.kv_dtype_bytes,
        )
        self.steps.append(
            StepRecord(
                out.step_id,
                out.phase,
                out.num_prefill_tokens,
                out.num_decode_seqs,
                wall_s,
                cost.flops,
                cost.bytes,
                started_s,
                len(out.preempted_request_ids),
                out.prefix_cache_queries_tokens,
                out.prefix_cache_hits_tokens,
            )
        )

    def _outputs(self) -> list[RequestOutput]:
        outputs = []
        for rid in list(self._tracked):
            o = self._output(self._tracked[rid])
            if o is not None:
                outputs.append(o)
        return outputs

    def _output(self, t: _Tracked) -> RequestOutput | None:
        req = t.request
        n_out = len(req.output_token_ids)
        if req.is_finished:
            # A stop token (eos or stop_token_ids) ends the text without appearing in it.
            by_token = req.status is RequestStatus.FINISHED_STOPPED and not t.detok.stopped
            self._feed(t, n_out - 1 if by_token else n_out)
            t.detok.flush()
        elif n_out == t.sent_tokens:
            return None
        else:
            self._feed(t, n_out)
        text = t.detok.output_text
        delta = text[t.sent_chars :]
        t.sent_chars, t.sent_tokens = len(text), n_out
        if req.is_finished:
            del self._tracked[req.request_id]
        return RequestOutput(
            req.request_id,
            req.prompt_token_ids,
            list(req.output_token_ids),
            text,
            delta,
            req.is_finished,
            req.finish_reason,
            list(t.logprobs),
            t.prompt_logprobs,
            req,
        )


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return replace(params, seed=seed)
