"""The state one app serves from: the engine loop, tokenizer, template, metrics, admission.

Admission counts sequences (a request with n=4 takes 4 seats) on the event loop thread only,
so it needs no lock. Seats are `max_num_seqs` running plus `max_queue` waiting; past that a
request gets 429 with Retry-After. While draining (SIGTERM) or with the engine down, 503.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from splitphase.engine.async_engine import AsyncEngine
from splitphase.engine.engine_client import EngineCoreClient
from splitphase.engine.llm import LLM
from splitphase.hardware.specs import HardwareSpec
from splitphase.model.checkpoint import CheckpointError, read_config, resolve_model_dir
from splitphase.server.chat import ChatTemplate
from splitphase.server.config import ServerConfig
from splitphase.server.errors import APIError, bad_request
from splitphase.server.metrics import EngineStats, ServerMetrics
from splitphase.server.supervisor import WorkerSupervisor

log = logging.getLogger("splitphase.server")
RETRY_AFTER_S = 1


class ServerState:
    """Everything the routes share; one per app."""

    def __init__(self, config: ServerConfig, llm: LLM, hardware: HardwareSpec | None) -> None:
        self.config, self.llm, self.tokenizer = config, llm, llm.tokenizer
        self.model_dir = _model_dir(config.model)
        self.chat = ChatTemplate.for_model_dir(self.model_dir, self.tokenizer)
        self.metrics = ServerMetrics(config.model_id, hardware, llm.dtype,
                                     config.utilization_window_s, config.kv_cache_dtype,
                                     (llm.engine.kv_block_size, llm.engine.kv_pool_blocks),
                                     {"policy": config.policy,
                                      "max_num_seqs": str(config.max_num_seqs),
                                      "max_num_batched_tokens": str(config.max_num_batched_tokens)})
        self.engine = AsyncEngine(llm.engine, on_steps=self.metrics.on_steps,
                                  max_step_records=config.max_step_records)
        self.max_model_len = int(llm.engine.max_model_len)
        self.vocab_size = _vocab_size(llm, self.model_dir)
        self.created = int(time.time())
        self.in_flight = 0  # admitted sequences not yet closed
        self.draining = False
        self._model_names = {config.model_id, config.model, Path(config.model).name}
        self._last_stats = EngineStats(0, 0)
        self.supervisor: WorkerSupervisor | None = None  # a disaggregated pair's restarter

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine loop (and, for a worker pair, its supervisor: on the event loop)."""
        self.engine.start()
        if hasattr(self.llm.engine, "check_workers") and self.supervisor is None:
            self.supervisor = WorkerSupervisor(self.engine, self.llm.engine)  # type: ignore[arg-type]
            self.supervisor.start()

    def stop(self) -> None:
        """Stop the engine loop (in-flight requests end with 503) and release workers."""
        self.draining = True
        if self.supervisor is not None:
            self.supervisor.stop()
        self.engine.shutdown()
        self.llm.close()

    def begin_drain(self) -> None:
        """SIGTERM: refuse new requests with 503; in-flight ones go on."""
        if not self.draining:
            log.info("draining: %d sequences in flight; new requests get 503", self.in_flight)
        self.draining = True

    def cut_in_flight(self, why: str) -> None:
        """End what is in flight with a 503 (an error event, not a cut stream) while stopping."""
        self.engine.fail_all(APIError(
            503, f"the server is shutting down ({why}); retry on another replica",
            code="shutting_down"))

    # ---- admission ---------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        """400 for a model this server does not serve (omitting it is fine)."""
        if name is not None and name not in self._model_names:
            raise bad_request(
                f"model {name!r} is not served here; this server serves {self.config.model_id!r}",
                "model", "model_not_found",
            )

    def admit(self, num_seqs: int) -> None:
        """Take `num_seqs` seats, or raise 503 (down, draining), 400 (too big) or 429 (full)."""
        if self.draining:
            raise APIError(503, "the server is shutting down; retry on another replica",
                           code="shutting_down")
        if not self.engine.is_running:
            raise APIError(503, "the engine is not running; retry later",
                           code="engine_unavailable")
        if self.supervisor is not None and not self.supervisor.serving:
            raise APIError(503, f"a worker of the disaggregated pair is being restarted; retry "
                           f"after {RETRY_AFTER_S} s", code="worker_unavailable",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        seats = self.config.max_num_seqs + self.config.max_queue
        if num_seqs > seats:
            raise bad_request(f"the request asks for {num_seqs} sequences (prompts x n); this "
                              f"server admits at most {seats} at once", "n")
        if self.in_flight + num_seqs > seats:
            raise APIError(
                429,
                f"the queue is full ({self.in_flight} of {seats} sequences in flight: "
                f"{self.config.max_num_seqs} running + {self.config.max_queue} waiting); "
                f"retry after {RETRY_AFTER_S} s",
                code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self.in_flight += num_seqs

    def release(self, num_seqs: int) -> None:
        """Give seats back."""
        self.in_flight = max(0, self.in_flight - num_seqs)

    # ---- health and stats --------------------------------------------------------------------
    def health(self) -> tuple[bool, dict[str, Any]]:
        """(healthy, detail): the loop is alive, and a step ended recently if work waits."""
        age_s = time.monotonic() - self.engine.last_step_s
        # Admitted requests count too: a loop stuck before it took them has no streams yet.
        busy = self.engine.num_in_flight > 0 or self.in_flight > 0
        detail: dict[str, Any] = {
            "status": "ok", "model": self.config.model_id, "engine_running": self.engine.is_running,
            "in_flight": self.in_flight, "last_step_age_s": round(age_s, 3),
            "step_errors": self.engine.error_count,
        }
        if self.supervisor is not None:
            detail.update(self.supervisor.status())
        if isinstance(self.llm.engine, EngineCoreClient):
            detail["engine_core_pid"] = self.llm.engine.proc.pid
        problem = None
        if self.draining:
            problem = "draining"
        elif not self.engine.is_running:
            problem = "engine loop is not running"
        elif busy and age_s > self.config.health_stall_s:
            problem = f"no engine step for {age_s:.1f} s with work queued"
        elif self.supervisor is not None and not self.supervisor.serving:
            problem = "a worker is dead or restarting"
        if problem:
            detail["status"] = "unhealthy"
            detail["reason"] = problem
        return problem is None, detail

    async def stats(self) -> EngineStats:
        """Queue and KV snapshot (read directly, or asked of a disaggregated pair)."""
        if isinstance(self.llm.engine, EngineCoreClient):  # as of the core's latest message
            core = self.llm.engine.state
            return EngineStats(core.num_running, core.num_waiting, core.num_used_blocks,
                               core.num_blocks)
        sched = getattr(self.llm.engine, "scheduler", None)
        if sched is not None:  # ints and lengths: safe to read from this thread
            bm = sched.block_manager
            return EngineStats(sched.num_running, sched.num_waiting, bm.num_used_blocks,
                               bm.num_blocks)
        usage_fn = getattr(self.llm.engine, "block_usage", None)
        if usage_fn is None or not self.engine.is_running:
            return EngineStats(self.in_flight, 0)
        try:
            usage = await asyncio.wait_for(self.engine.call(lambda: usage_fn(1.0)), 2.0)
        except Exception as exc:  # a slow or broken pair keeps the previous numbers
            log.warning("block usage unavailable: %r", exc)
            return self._last_stats
        self._last_stats = EngineStats(
            sum(u.get("num_running", 0) for u in usage.values()),
            sum(u.get("num_waiting", 0) for u in usage.values()),
            sum(u.get("num_used_blocks", 0) for u in usage.values()),
            sum(u.get("num_blocks", 0) for u in usage.values()),
        )
        return self._last_stats


def _model_dir(name: str) -> Path | None:
    try:
        return resolve_model_dir(name)
    except CheckpointError:
        return None


def _vocab_size(llm: LLM, model_dir: Path | None) -> int:
    if llm.model is not None:
        return int(llm.model.cfg.vocab_size)
    if model_dir is not None:
        return int(read_config(model_dir)[0].vocab_size)
    return llm.tokenizer.vocab_size
