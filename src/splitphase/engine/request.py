"""One request's tokens, progress, status and timing (vLLM v1 `Request`, nano-vllm `Sequence`).

Torch-free bookkeeping. Every timestamp is passed in by the caller (`now_s`), never read from a
clock here, so the simulator can drive the same objects with simulated time.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from splitphase.engine.sampling_params import SamplingParams
from splitphase.errors import UserError


class RequestError(ValueError):
    """A request that cannot be built as given; the message says what to fix."""


class RequestStatus(enum.Enum):
    """Where a request is in its life; the FINISHED_* states are terminal."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    def is_finished(self) -> bool:
        """True for the terminal states (also callable as `RequestStatus.is_finished(s)`)."""
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """OpenAI-style reason ("stop", "length", "abort", "error"), None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


_isfinite = math.isfinite


def _is_token_id(t: object) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


@dataclass(eq=False)  # a request is an entity: identity, not field-wise equality
class Request:
    """Prompt, sampled tokens, progress through the KV cache, status and per-token timing."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time_s: float = 0.0
    eos_token_id: int | None = None  # overrides SchedulerConfig.eos_token_id when set
    # n > 1 sampling: children are forked from sample 0 after its prompt; they name their parent.
    parent_id: str | None = None
    sample_index: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose KV is in the cache. The last sampled token is never computed yet, so a
    # decoding request has num_computed_tokens == num_tokens - 1.
    num_computed_tokens: int = 0
    # Tokens the current (re)prefill must cover: the prompt, or prompt + outputs after a
    # preemption by recompute. The request is prefilling while num_computed < prefill_len.
    prefill_len: int = 0
    num_cached_tokens: int = 0  # prefix-cache hits at the latest admission
    # False when every prompt position must be computed (prompt logprobs need their logits).
    use_prefix_cache: bool = True
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    # Written by the BlockManager (always a fresh copy of its own table); read-only elsewhere.
    block_table: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    finished_s: float | None = None
    children: list[Request] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise RequestError(f"request_id must be a non-empty string, got {self.request_id!r}")
        self.prompt_token_ids = list(self.prompt_token_ids)
        if not self.prompt_token_ids:
            raise RequestError(f"request {self.request_id!r}: the prompt must have >= 1 token")
        ids = self.prompt_token_ids
        # Fast path (C-level map/min; the simulator builds millions of these); the slow path
        # names the offending ids and accepts int subclasses other than bool, as before.
        fast_ok = set(map(type, ids)) == {int} and min(ids) >= 0
        bad = [] if fast_ok else [t for t in ids if not _is_token_id(t)]
        if bad:
            raise RequestError(
                f"request {self.request_id!r}: prompt token ids must be integers >= 0, "
                f"got {bad[:5]!r}"
            )
        if not isinstance(self.sampling_params, SamplingParams):
            raise RequestError("sampling_params must be a SamplingParams instance")
        _check_time("arrival_time_s", self.arrival_time_s)
        if self.eos_token_id is not None and not _is_token_id(self.eos_token_id):
            raise RequestError(f"eos_token_id must be None or >= 0, got {self.eos_token_id!r}")
        self.output_token_ids = list(self.output_token_ids)
        if self.prefill_len == 0:
            self.prefill_len = self.num_tokens

    # ---- tokens -------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens sampled so far."""
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus sampled tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """A new list: prompt followed by the sampled tokens."""
        return self.prompt_token_ids + self.output_token_ids

    def get_token_ids(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) without building the whole sequence."""
        if not 0 <= start <= end <= self.num_tokens:
            raise IndexError(f"token range [{start}, {end}) outside [0, {self.num_tokens})")
        p = self.num_prompt_tokens
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def last_token_id(self) -> int:
        """The token at position num_tokens - 1 (the one a decode step feeds)."""
        return (self.output_token_ids or self.prompt_token_ids)[-1]

    @property
    def is_prefilling(self) -> bool:
        """True while the current (re)prefill has tokens left to compute."""
        return self.num_computed_tokens < self.prefill_len

    @property
    def is_finished(self) -> bool:
        """True once the status is terminal."""
        return self.status.is_finished()

    # ---- events (the caller passes the time) ---------------------------------------------
    def record_scheduled(self, now_s: float) -> None:
        """Note the first time the request is scheduled (a re-admission keeps the first)."""
        if self.first_scheduled_s is None:
            _check_time("now_s", now_s)
            self.first_scheduled_s = now_s

    def append_output_token(self, token_id: int, now_s: float) -> None:
        """Append one sampled token produced at `now_s`."""
        # Once per generated token: exact int/float types take the quick checks (a bool's type
        # is bool, so it still goes to the full check and is refused there).
        if (type(token_id) is not int or token_id < 0) and not _is_token_id(token_id):
            raise RequestError(f"sampled token id must be an integer >= 0, got {token_id!r}")
        if type(now_s) is not float or not _isfinite(now_s):
            _check_time("now_s", now_s)
        self.output_token_ids.append(token_id)
        self.token_times_s.append(now_s)
        if self.first_token_s is None:
            self.first_token_s = now_s

    def finish(self, status: RequestStatus, now_s: float | None = None) -> None:
        """Move to a terminal status and record the finish reason."""
        if not status.is_finished():
            raise RequestError(f"finish() needs a FINISHED_* status, got {status}")
        self.status = status
        self.finish_reason = status.finish_reason
        if now_s is not None:
            _check_time("now_s", now_s)
            self.finished_s = now_s

    # ---- timing, in seconds (None until the events have happened) ---------------------------
    @property
    def queue_s(self) -> float | None:
        """Arrival to first scheduled."""
        return _diff(self.first_scheduled_s, self.arrival_time_s)

    @property
    def prefill_s(self) -> float | None:
        """First scheduled to first token (covers every prefill chunk)."""
        return _diff(self.first_token_s, self.first_scheduled_s)

    @property
    def ttft_s(self) -> float | None:
        """Time to first token: arrival to first token."""
        return _diff(self.first_token_s, self.arrival_time_s)

    @property
    def decode_s(self) -> float | None:
        """First token to last token."""
        if not self.token_times_s:
            return None
        return _diff(self.token_times_s[-1], self.first_token_s)

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (None with fewer than two tokens)."""
        decode_s = self.decode_s
        if decode_s is None or len(self.token_times_s) < 2:
            return None
        return decode_s / (len(self.token_times_s) - 1)

    @property
    def inter_token_s(self) -> list[float]:
        """Gaps between consecutive output tokens."""
        t = self.token_times_s
        return [b - a for a, b in zip(t[:-1], t[1:], strict=True)]


def _diff(end: float | None, start: float | None) -> float | None:
    return None if end is None or start is None else end - start


def _check_time(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"{name} must be a finite number of seconds, got {value!r}")


def validate_prompt(
    ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int
) -> None:
    """A request an engine can serve: a non-empty prompt in the vocabulary that fits with its
    max_tokens, and logit_bias on tokens of the vocabulary (one outside it would fail the
    sampler, so the whole step, for every request in it)."""
    if not ids:
        raise UserError("the prompt is empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise UserError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    biased = [t for t, _ in params.logit_bias if t >= vocab_size]
    if biased:
        raise UserError(f"logit_bias has token ids {biased[:5]} outside the vocabulary "
                        f"[0, {vocab_size})")
    if len(ids) + params.max_tokens > max_model_len:
        total = len(ids) + params.max_tokens
        raise UserError(
            f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {total}"
            f" exceeds the context length {max_model_len}"
        )
