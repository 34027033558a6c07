"""AsyncEngine: the engine loop on its own thread, per-request async streams, abort.

The LLMEngine is single-threaded by design. The event loop never touches it: it sends
commands (add, abort) through a thread-safe queue, and the engine thread drains them between
steps and pushes each request's outputs back with `call_soon_threadsafe`. A step that raises
(a failing forward) turns every request it held into an explicit error, and the loop goes on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from splitphase.engine.llm_engine import RequestOutput, StepFailedError, StepRecord
from splitphase.engine.request import RequestStatus
from splitphase.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")


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

    def __init__(self, message: str, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.cause = cause  # what the step raised (a WorkerDiedError: the pair lost a worker)


class EngineDeadError(RuntimeError):
    """The engine loop is not running."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


class AsyncEngine:
    """Runs an LLMEngine on a background thread; `generate` yields a request's outputs."""

    def __init__(
        self,
        engine: StepEngine,
        idle_wait_s: float = 0.005,
        on_steps: Callable[[Sequence[StepRecord]], None] | None = None,
        max_step_records: int | None = None,
    ) -> None:
        self.engine = engine
        # Called on the engine thread with each batch of new `engine.steps` records (metrics).
        self.on_steps = on_steps
        # A server runs for days: keep at most this many records in `engine.steps`.
        self.max_step_records = max_step_records
        self._steps_seen = 0
        self._commands: queue.Queue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = (
            queue.Queue()
        )
        self._streams: dict[str, _Stream] = {}
        # An engine that blocks in `step()` on another process (EngineCoreClient) has `wake`:
        # called after each command is queued, so the command need not wait out a step.
        self._wake: Callable[[], None] | None = getattr(engine, "wake", None)
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
        self._put_command(fn, fut)
        if not self.is_running:  # the loop stopped between the check and the put
            self._fail_commands(EngineDeadError("the engine loop is not running"))
        return await asyncio.wrap_future(fut)

    async def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine thread between two steps and return its result."""
        result: T = await self._call(fn)
        return result

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        prompt_logprobs: int | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Add a request and yield its outputs until it finishes (aborts it if the caller stops)."""
        return self.generate_all([prompt], params, [request_id], prompt_logprobs)

    async def generate_all(
        self,
        prompts: Sequence[str | list[int]],
        params: SamplingParams,
        request_ids: Sequence[str],
        prompt_logprobs: int | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Add one request per prompt; yield all their outputs, merged in step order, until
        every one finished (the unfinished are aborted if the caller stops).

        One queue serves them all, so the caller awaits one queue, with no task per prompt in
        between: every hop per token lengthens the engine's steps (they share the GIL).
        """
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        rids = {rid: parent for parent in request_ids
                for rid in [parent, *(f"{parent}#{k}" for k in range(1, params.n))]}

        def add() -> None:
            added: list[str] = []
            try:
                for prompt, parent in zip(prompts, request_ids, strict=True):
                    self.engine.add_request(prompt, params, parent,
                                            prompt_logprobs=prompt_logprobs)
                    added.append(parent)
            except BaseException:
                for parent in added:  # all or none: a bad prompt must not leave the others
                    self.engine.abort_request(parent)
                raise
            for rid in rids:
                self._streams[rid] = stream

        try:
            await self._call(add)
        except asyncio.CancelledError:
            # The caller left (its client disconnected) while the add waited for the engine
            # thread: the add still runs there, so its abort is queued behind it. Without this
            # the request ran to max_tokens for nobody.
            for parent in request_ids:
                self.abort(parent)
            raise
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
            for parent in sorted({rids[rid] for rid in pending}):
                self.abort(parent)

    def abort(self, request_id: str) -> None:
        """Abort from any thread; blocks are freed on the engine thread before the next step."""
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._put_command(lambda: self._abort_now(request_id), fut)

    def fail_all(self, exc: BaseException) -> None:
        """End every request in flight with `exc` (from any thread; before the next step)."""
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._put_command(lambda: self._fail_in_flight(exc), fut)

    def _put_command(self, fn: Callable[[], Any], fut: concurrent.futures.Future[Any]) -> None:
        self._commands.put((fn, fut))
        if self._wake is not None:
            self._wake()

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
            self._run_command(fn, fut)
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return

    @staticmethod
    def _run_command(fn: Callable[[], Any], fut: concurrent.futures.Future[Any]) -> None:
        """Run one command and hand its result or error to the caller. A caller that gave up
        (its task cancelled: a client timed out) has cancelled the future; the command still
        runs (an add must be matched by its abort), and nothing is set on a cancelled future:
        setting one raised InvalidStateError and crashed the engine loop, every later request
        answered 503 (seen once in 200 client timeouts). A running future cannot be cancelled,
        so the set below cannot race a cancel."""
        listening = fut.set_running_or_notify_cancel()
        try:
            result = fn()
        except BaseException as exc:  # the caller gets the error (e.g. a UserError)
            if listening:
                fut.set_exception(exc)
        else:
            if listening:
                fut.set_result(result)

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException:  # an engine bug must not leave streams waiting forever
            log.exception("the engine loop crashed")
            self.error_count += 1
        finally:
            why = "the engine was shut down" if self._stop.is_set() else "the engine loop crashed"
            self._fail_in_flight(EngineDeadError(why))
            self._fail_commands(EngineDeadError(why))

    def _loop(self) -> None:
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
                    err = EngineStepError(f"request {rid} failed: {exc.cause!r}", exc.cause)
                    self._deliver(rid, err)
                    self._streams.pop(rid, None)
                self._publish_steps()
                continue
            self.last_step_s = time.monotonic()
            # Step records first: a client that sees its last token also sees its step counted.
            self._publish_steps()
            self._deliver_step(outputs)

    def _publish_steps(self) -> None:
        """Hand new StepRecords to `on_steps`, then trim `engine.steps` to `max_step_records`."""
        steps: list[StepRecord] | None = getattr(self.engine, "steps", None)
        if steps is None:
            return
        self._steps_seen = min(self._steps_seen, len(steps))  # the engine may have reset it
        if self.on_steps is not None and len(steps) > self._steps_seen:
            try:
                self.on_steps(steps[self._steps_seen :])
            except Exception:  # a metrics bug must not stop serving
                log.exception("on_steps callback failed")
        if self.max_step_records is not None and len(steps) > self.max_step_records:
            del steps[: len(steps) - self.max_step_records]
        self._steps_seen = len(steps)

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs over with one wake-up per event loop, not one per request:
        each `call_soon_threadsafe` writes to the loop's self-pipe and costs a loop iteration."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
            if stream is not None:
                batches.setdefault(stream.loop, []).append((stream, out))
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the caller's event loop is closed: nobody is listening
                for _, out in batch:
                    self._streams.pop(out.request_id, None)

    def _deliver(self, rid: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(rid)
        if stream is not None:
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
            except RuntimeError:  # the caller's event loop is closed: nobody is listening
                self._streams.pop(rid, None)

    def _fail_commands(self, exc: BaseException) -> None:
        """Fail commands still queued when the loop stops, so no caller awaits forever."""
        while True:
            try:
                _, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if not fut.done():
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    fut.set_exception(exc)

    def _fail_in_flight(self, exc: BaseException) -> None:
        """End every tracked request with an error (their blocks are freed)."""
        for rid in list(self._streams):
            try:
                self.engine.abort_request(rid, RequestStatus.FINISHED_ERROR)
            except Exception:  # a broken engine still owes its callers an answer
                log.exception("abort of %s failed", rid)
            self._deliver(rid, exc)
            self._streams.pop(rid, None)


def _put_all(batch: list[tuple[_Stream, RequestOutput]]) -> None:
    """On the event loop: one step's outputs into their streams."""
    for stream, out in batch:
        stream.queue.put_nowait(out)
