"""What one `splitphase serve` process serves and how it guards itself: a validated dataclass."""

from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass
from typing import Any

from splitphase.engine.config import COMPILE_PHASES, KV_CACHE_DTYPES, EngineConfig
from splitphase.errors import UserError

MAX_BODY_BYTES = 4 * 2**20  # 4 MiB: a batch of 2k-token prompts is far smaller; a book is not


def serve_policies() -> tuple[str, ...]:
    """Policies `serve` accepts: disaggregated only where its engine module is installed."""
    base = ("mixed", "chunked")
    if importlib.util.find_spec("splitphase.engine.disagg") is not None:
        return (*base, "disaggregated")
    return base


@dataclass(frozen=True)
class ServerConfig:
    """Model, engine limits, admission limits and shutdown behaviour of one server."""

    model: str = "small"
    policy: str = "chunked"
    served_model_name: str | None = None  # the `model` id clients send; default: `model`
    api_key: str | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # tokens a step may carry: the chunked prefill budget
    block_size: int = 16  # tokens per K/V block
    enable_prefix_caching: bool = True
    seed: int = 0  # of sampling for requests that give no seed
    max_queue: int = 1024  # sequences waiting beyond max_num_seqs before 429
    hardware: str | None = None  # peaks for the utilization gauges; None: cpu on CPU, else guess
    device: str = "auto"
    dtype: str | None = None
    num_blocks: int | None = None  # KV pool size override (tests); None: the memory budget
    kv_cache_bytes: int | None = None  # the K/V pool's bytes; None: a share of free memory
    max_model_len: int | None = None  # longest prompt + output; None: what model and pool allow
    max_body_bytes: int = MAX_BODY_BYTES
    shutdown_timeout_s: float = 30.0  # SIGTERM: how long in-flight requests may finish
    health_stall_s: float = 30.0  # /health fails when work waits and no step ended this long
    utilization_window_s: float = 10.0  # the utilization gauges average steps this recent
    max_step_records: int = 4096
    # The engine in its own process (engine/engine_core.py) instead of a thread of this one:
    # the event loop then never holds the GIL the engine's steps need. None: yes, except for
    # disaggregated (its engine already drives worker processes). See `runs_engine_process`.
    engine_process: bool | None = None
    compile: tuple[str, ...] = ()  # phases run through torch.compile (EngineConfig.compile)
    kv_cache_dtype: str = "auto"  # the K/V pool's dtype (EngineConfig.kv_cache_dtype)

    def __post_init__(self) -> None:
        if self.policy not in serve_policies():
            raise UserError(
                f"--policy must be one of {', '.join(serve_policies())}, got {self.policy!r}"
                + (
                    " (splitphase.engine.disagg is not installed)"
                    if self.policy == "disaggregated"
                    else ""
                )
            )
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_body_bytes",
                     "max_step_records", "kv_cache_bytes", "max_model_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.max_queue < 0:
            raise UserError(f"--max-queue must be >= 0, got {self.max_queue}")
        for name in ("shutdown_timeout_s", "health_stall_s", "utilization_window_s"):
            if not getattr(self, name) > 0:
                raise UserError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.engine_process and self.policy == "disaggregated":
            raise UserError("--engine-process is for the mixed and chunked policies; the "
                            "disaggregated policy already runs its engines in worker processes")
        bad = [p for p in self.compile if p not in COMPILE_PHASES]
        if bad:
            raise UserError(f"--compile takes phases among {','.join(COMPILE_PHASES)} "
                            f"(comma-separated), got {','.join(bad)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise UserError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                            f"got {self.kv_cache_dtype!r}")
        if self.api_key is not None and not self.api_key.strip():
            raise UserError("--api-key must not be empty (omit it to serve without a key)")
        # The rest of the engine's checks (how its fields go together), before any process
        # starts; a pair's workers each build one as a role, and either role checks the same.
        role = "decode" if self.policy == "disaggregated" else None
        EngineConfig(**self.engine_kwargs(), role=role)

    @property
    def model_id(self) -> str:
        """The id `/v1/models` lists and requests name."""
        return self.served_model_name or self.model

    @property
    def runs_engine_process(self) -> bool:
        """Whether the engine runs in its own process (README "Server overhead")."""
        if self.engine_process is None:
            return self.policy != "disaggregated"
        return self.engine_process

    def engine_kwargs(self) -> dict[str, Any]:
        """EngineConfig fields for `LLM(...)`."""
        kwargs: dict[str, Any] = {
            "policy": self.policy, "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens, "block_size": self.block_size,
            "enable_prefix_caching": self.enable_prefix_caching, "seed": self.seed,
        }
        if self.compile:
            kwargs["compile"] = tuple(self.compile)
        if self.num_blocks is not None:
            kwargs["num_blocks"] = self.num_blocks
        for name in ("kv_cache_bytes", "max_model_len"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        if self.kv_cache_dtype != "auto":
            kwargs["kv_cache_dtype"] = self.kv_cache_dtype
        return kwargs

    def redacted(self) -> dict[str, Any]:
        """The config for logs: the API key is never printed."""
        d = asdict(self)
        d["api_key"] = "<set>" if self.api_key else None
        return d
