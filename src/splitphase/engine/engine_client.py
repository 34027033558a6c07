"""The API process's handle on an engine core process (`engine_core.py`): a `StepEngine`.

`AsyncEngine` drives it like a local LLMEngine from its engine thread. `add_request` tokenizes
and validates here (a bad prompt raises the engine's UserError at once), then sends the request
without waiting; `abort_request` too. `step()` returns the next step the core already ran (it
steps back to back and does not wait for this side), so this thread mostly sleeps in the pipe,
without the GIL. `steps` collects the core's step records for the metrics, and `state` is the
core's latest queue and KV snapshot (the gauges).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from splitphase.engine.async_engine import EngineDeadError
from splitphase.engine.engine_core import CoreState
from splitphase.engine.engine_wire import DeltaDecoder, OutputDelta
from splitphase.engine.llm_engine import LLMEngine, RequestOutput, StepFailedError, StepRecord
from splitphase.engine.request import RequestStatus, validate_prompt
from splitphase.engine.sampling_params import SamplingParams
from splitphase.model.tokenizer import Tokenizer


class EngineCoreDiedError(EngineDeadError):
    """The engine core process exited; the message gives its exit code (the server: 503)."""


class EngineCoreClient:
    """A StepEngine whose engine runs in a child process; `close()` stops it."""

    def __init__(self, conn: Connection, proc: subprocess.Popen[bytes], tokenizer: Tokenizer,
                 info: dict[str, Any]) -> None:
        self._conn, self.proc, self.tokenizer = conn, proc, tokenizer
        self.max_model_len: int = info["max_model_len"]
        self.vocab_size: int = info["vocab_size"]
        self.kv_pool_blocks: int = info["kv_pool_blocks"]
        self.kv_block_size: int = info["kv_block_size"]
        self.steps: list[StepRecord] = []
        self.state = CoreState(False, 0, 0, 0, 0, 0)
        self._sent = 0  # commands sent; the core has handled `state.commands_handled` of them
        self._ids = itertools.count()
        self._decoder = DeltaDecoder()
        # `wake()` ends a `step()` that waits for the core: a command queued meanwhile (an add,
        # an abort) then goes out now instead of after the core's next step.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    @classmethod
    def launch(cls, factory: Callable[[], LLMEngine], tokenizer: Tokenizer,
               startup_timeout_s: float = 600.0) -> EngineCoreClient:
        """Start the core, wait until its engine is built (it loads the model itself)."""
        # A fresh interpreter (`python -m splitphase.engine.engine_core FD`), not a fork: a
        # forked child of a process with threads or CUDA is not safe. Not multiprocessing's
        # spawn either: it re-runs the caller's main script, which a script without a
        # `__main__` guard does not survive.
        parent_sock, child_sock = socket.socketpair()
        fd = child_sock.fileno()
        proc = subprocess.Popen([sys.executable, "-m", "splitphase.engine.engine_core", str(fd)],
                                pass_fds=(fd,))
        child_sock.close()
        conn = Connection(parent_sock.detach())
        answered, msg = False, None
        try:
            conn.send(sys.path)  # first, so the core can import what `factory` names
            conn.send(factory)
            answered = conn.poll(startup_timeout_s)
            msg = conn.recv() if answered else None
        except (EOFError, OSError):  # it died while starting
            answered = True
        if msg is None or msg[0] != "ready":
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5 if answered else 0)  # an answer but no engine: it is exiting
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
            conn.close()
            if msg is not None and msg[0] == "error":
                raise msg[1]
            raise EngineCoreDiedError(f"the engine core did not start (exit code "
                                      f"{proc.returncode}; its error is printed above)")
        return cls(conn, proc, tokenizer, msg[1])

    # ---- StepEngine --------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_s: float | None = None,
        prompt_logprobs: int | None = None,
    ) -> str:
        """Validate here (UserError as the engine would raise it), queue in the core."""
        params = params or SamplingParams()
        ids = (self.tokenizer.encode(prompt, add_bos=True) if isinstance(prompt, str)
               else list(prompt))
        validate_prompt(ids, params, self.vocab_size, self.max_model_len)
        rid = request_id or f"core-req-{next(self._ids)}"
        # perf_counter is one clock for every process on the host: queue time counts the pipe.
        arrival_s = time.perf_counter() if arrival_s is None else arrival_s
        self._send(("add", ids, params, rid, arrival_s, prompt_logprobs))
        return rid

    def abort_request(
        self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> None:
        """Aborted (blocks freed) by the core before its next step."""
        self._send(("abort", request_id, status))

    def has_unfinished_requests(self) -> bool:
        if self.state.has_unfinished or self._sent > self.state.commands_handled:
            return True
        # Idle, the loop asks this every few ms: a core that died then stops the loop at once
        # (busy, `step()` finds its closed pipe).
        if self.proc.poll() is not None:
            raise self._died()
        return False

    def wake(self) -> None:
        """From any thread: a command is queued; a `step()` waiting now returns [] at once."""
        with contextlib.suppress(BlockingIOError):  # full: a wake-up is pending anyway
            os.write(self._wake_w, b"w")

    def step(self) -> list[RequestOutput]:
        """The core's next message: a step's outputs (blocks until it is done), nothing (it
        handled the commands and went idle, or `wake()` was called), or the StepFailedError
        it raised."""
        if not self._conn.poll(0) and self._conn not in wait([self._conn, self._wake_r]):
            with contextlib.suppress(BlockingIOError):
                os.read(self._wake_r, 4096)
            return []
        kind, *body, _ = self._recv()  # the state, last, is kept by _recv
        self.steps.extend(body[-1])  # every message ends with the new step records
        if kind == "failed":
            request_ids, cause, _ = body
            raise StepFailedError(request_ids, cause)
        if kind == "idle":
            return []
        deltas: list[OutputDelta] = body[0]
        return [self._decoder.decode(d) for d in deltas]

    # ---- lifecycle ---------------------------------------------------------------------------
    def close(self, timeout_s: float = 10.0) -> None:
        """Ask the core to stop after its current step; kill it if it does not."""
        with contextlib.suppress(OSError, ValueError):  # already gone
            self._conn.send(("close",))
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self._conn.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # ---- plumbing ----------------------------------------------------------------------------
    def _send(self, msg: tuple[Any, ...]) -> None:
        try:
            self._conn.send(msg)
        except (OSError, ValueError) as exc:
            raise self._died() from exc
        self._sent += 1

    def _recv(self) -> tuple[Any, ...]:
        try:
            msg: tuple[Any, ...] = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise self._died() from exc
        self.state = msg[-1]  # messages come in order: the newest state is the core's now
        return msg

    def _died(self) -> EngineCoreDiedError:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(1)
        if self.proc.returncode is None:
            return EngineCoreDiedError("the engine core process closed its pipe")
        return EngineCoreDiedError(
            f"the engine core process exited with code {self.proc.returncode}")
