"""Scheduler configuration: policy, role, batch limits and KV pool geometry (no torch)."""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("mixed", "chunked", "disaggregated")
ROLES = ("prefill", "decode")


class SchedulerError(ValueError):
    """A scheduler configuration or call that cannot work; the message says what to change."""


def _positive_int(name: str, value: object, lo: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise SchedulerError(f"{name} must be an integer >= {lo}, got {value!r}")
    return value


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduling policy, batch limits and KV pool geometry."""

    policy: str = "chunked"
    role: str | None = None  # "prefill" or "decode", only with policy="disaggregated"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int | None = None  # per-request chunk cap (vLLM v1)
    enable_prefix_caching: bool = True
    block_size: int = 16
    num_blocks: int = 1024
    # None: num_blocks * block_size, capped at max_num_batched_tokens for "mixed".
    max_model_len: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise SchedulerError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if (self.policy == "disaggregated") != (self.role is not None) or (
            self.role is not None and self.role not in ROLES
        ):
            raise SchedulerError(
                f"a disaggregated deployment runs two schedulers: set role to one of {ROLES}"
                f" with policy='disaggregated' (and role=None otherwise); got policy="
                f"{self.policy!r}, role={self.role!r}"
            )
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_blocks"):
            _positive_int(name, getattr(self, name))
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Every running sequence must be able to decode in the same step (vLLM's rule too).
            raise SchedulerError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >="
                f" max_num_seqs ({self.max_num_seqs})"
            )
        if self.long_prefill_token_threshold is not None:
            _positive_int("long_prefill_token_threshold", self.long_prefill_token_threshold)
            if self.policy == "mixed":
                raise SchedulerError(
                    "long_prefill_token_threshold caps prompt chunks; policy='mixed' runs"
                    " whole prompts: use policy='chunked' or drop the threshold"
                )
        if not isinstance(self.enable_prefix_caching, bool):
            raise SchedulerError(
                f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}"
            )
        if self.eos_token_id is not None:
            _positive_int("eos_token_id", self.eos_token_id, lo=0)
        self._check_max_model_len()

    def _check_max_model_len(self) -> None:
        pool_tokens = self.num_blocks * self.block_size
        if self.max_model_len is None:
            default = pool_tokens
            if self.policy == "mixed":
                default = min(default, self.max_num_batched_tokens)
            object.__setattr__(self, "max_model_len", default)
        n = _positive_int("max_model_len", self.max_model_len)
        if n > pool_tokens:
            raise SchedulerError(
                f"max_model_len ({n}) exceeds the KV pool ({self.num_blocks} blocks x"
                f" {self.block_size} = {pool_tokens} tokens): one request must fit alone"
            )
        if self.policy == "mixed" and n > self.max_num_batched_tokens:
            raise SchedulerError(
                f"policy='mixed' runs each prompt (or recompute) whole, so max_model_len ({n})"
                f" must be <= max_num_batched_tokens ({self.max_num_batched_tokens});"
                " raise the budget or use policy='chunked'"
            )
