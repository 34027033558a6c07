"""AsyncEngine: the engine loop on its own thread, per-request async streams, abort.

The LLMEngine is single-threaded by design. The event loop never touches it: it sends
commands (add, abort) through a thread-safe queue, and the engine thread drains them between
steps and pushes each request's outputs back with `call_soon_threadsafe`. A step that raises
(a failing forward) turns every request it held into an explicit error, and the loop goes on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from splitphase.engine.llm_engine import RequestOutput, StepFailedError
from splitphase.engine.request import RequestStatus
from splitphase.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class StepEngine(Protocol):
    """What the loop needs of an engine: LLMEngine, or the disaggregated front end."""

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_s: float | None = None,
        prompt_logprobs: int | None = None,
    ) -> str: ...

    def step(self) -> list[RequestOutput]: ...

    def abort_request(
        self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> None: ...

    def has_unfinished_requests(self) -> bool: ...


class EngineStepError(RuntimeError):
    """The model step that served this request failed; the request was ended."""


class EngineDeadError(RuntimeError):
    """The engine loop is not running."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


class AsyncEngine:
    """Runs an LLMEngine on a background thread; `generate` yields a request's outputs."""

    def __init__(self, engine: StepEngine, idle_wait_s: float = 0.005) -> None:
        self.engine = engine
        self._commands: queue.Queue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = (
            queue.Queue()
        )
        self._streams: dict[str, _Stream] = {}
        self._idle_wait_s = idle_wait_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_step_s = time.monotonic()
        self.error_count = 0

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="splitphase-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ---- requests ----------------------------------------------------------------------------
    async def _call(self, fn: Callable[[], Any]) -> Any:
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._commands.put((fn, fut))
        return await asyncio.wrap_future(fut)

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        prompt_logprobs: int | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs until it finishes (aborts it if the caller stops)."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        rids = [request_id] + [f"{request_id}#{k}" for k in range(1, params.n)]

        def add() -> None:
            self.engine.add_request(prompt, params, request_id, prompt_logprobs=prompt_logprobs)
            for rid in rids:
                self._streams[rid] = stream

        await self._call(add)
        pending = set(rids)
        try:
            while pending:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    pending.discard(item.request_id)
                yield item
        finally:
            if pending:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort from any thread; blocks are freed on the engine thread before the next step."""
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._commands.put((lambda: self._abort_now(request_id), fut))

    def _abort_now(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        for rid in [r for r in self._streams if r == request_id or r.startswith(request_id + "#")]:
            self._streams.pop(rid, None)

    # ---- the loop ----------------------------------------------------------------------------
    def _drain_commands(self, block: bool) -> None:
        try:
            fn, fut = (
                self._commands.get(timeout=self._idle_wait_s)
                if block
                else self._commands.get_nowait()
            )
        except queue.Empty:
            return
        while True:
            try:
                fut.set_result(fn())
            except BaseException as exc:  # the caller gets the error (e.g. a UserError)
                fut.set_exception(exc)
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain_commands(block=not self.engine.has_unfinished_requests())
            if not self.engine.has_unfinished_requests():
                self.last_step_s = time.monotonic()
                continue
            try:
                outputs = self.engine.step()
            except StepFailedError as exc:  # a failed step must not kill the server
                log.error("engine step failed: %r", exc.cause)
                self.error_count += 1
                for rid in exc.request_ids:
                    self._deliver(rid, EngineStepError(f"request {rid} failed: {exc.cause!r}"))
                    self._streams.pop(rid, None)
                continue
            self.last_step_s = time.monotonic()
            for out in outputs:
                self._deliver(out.request_id, out)
                if out.finished:
                    self._streams.pop(out.request_id, None)
        self._fail_in_flight(EngineDeadError("the engine was shut down"))

    def _deliver(self, rid: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(rid)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _fail_in_flight(self, exc: BaseException) -> None:
        """End every tracked request with an error (their blocks are freed)."""
        for rid in list(self._streams):
            self.engine.abort_request(rid, RequestStatus.FINISHED_ERROR)
            self._deliver(rid, exc)
            self._streams.pop(rid, None)
