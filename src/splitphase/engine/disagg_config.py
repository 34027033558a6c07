"""Configuration and result types of a disaggregated pair (see `splitphase.engine.disagg`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from splitphase.engine.disagg_worker import ENGINE_FIELDS
from splitphase.engine.kv_transfer import BACKENDS
from splitphase.engine.llm_engine import StepRecord
from splitphase.errors import UserError


class WorkerDiedError(RuntimeError):
    """A worker of the pair is gone; its requests ended with errors. Call restart()."""


@dataclass(frozen=True)
class WorkerStepRecord(StepRecord):
    """A worker's engine step, tagged with the worker's role."""

    role: str = ""


@dataclass(frozen=True)
class DisaggConfig:
    """Where the two workers run, how they talk, and the engine options of each."""

    model: str  # embedded name or checkpoint directory, loaded by each worker
    tokenizer_dir: str | None = None  # default: the model's own tokenizer
    prefill_device: str = "cpu"
    decode_device: str = "cpu"
    dtype: str | None = None
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields, both workers
    decode_engine: dict[str, Any] = field(default_factory=dict)  # decode overrides (its pool)
    host: str = "127.0.0.1"  # the control listener; also the local pair's process group
    control_port: int = 0  # 0: any free port (local workers are told which)
    spawn_workers: bool = True  # False: wait for `splitphase worker` processes to dial in
    backend: str = "auto"  # auto: nccl when both local workers are on distinct GPUs, else gloo
    timeout_s: float = 60.0  # transfer timeout and the longest silence tolerated of a worker
    startup_timeout_s: float = 120.0
    worker_threads: int | None = None  # torch threads per local worker
    poll_s: float = 0.01  # how long step() waits for news when none is there

    def __post_init__(self) -> None:
        for name in ("engine", "decode_engine"):
            bad = sorted(set(getattr(self, name)) - set(ENGINE_FIELDS))
            if bad:
                raise UserError(f"unknown {name} options {bad}; known: {list(ENGINE_FIELDS)}")
        if self.backend not in BACKENDS:
            raise UserError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        for name in ("timeout_s", "startup_timeout_s", "poll_s"):
            if not getattr(self, name) > 0:
                raise UserError(f"{name} must be > 0 seconds, got {getattr(self, name)}")

    def local_backend(self) -> str:
        """The backend both local workers use (nccl cannot pair two ranks on one GPU)."""
        if self.backend != "auto":
            return self.backend
        devices = {_canonical(self.prefill_device), _canonical(self.decode_device)}
        two_gpus = len(devices) == 2 and all(d.startswith("cuda") for d in devices)
        return "nccl" if two_gpus else "gloo"


def _canonical(device: str) -> str:
    return "cuda:0" if device == "cuda" else device
