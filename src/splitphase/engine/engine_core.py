"""The engine core process: an LLMEngine stepping back to back, driven over a pipe.

Why a process: in a server the engine thread shares the GIL with the event loop. Every native
op releases the GIL and must take it back, so while the event loop runs Python (HTTP, SSE) the
engine's steps stretch (a GIL convoy); a busy neighbour *process* costs it almost nothing.
vLLM v1 splits the same way (its EngineCore process). Here the core loop only schedules,
runs the model, samples and detokenizes; the API process does HTTP and streams.

The protocol (pickled tuples on one duplex `Connection`; after "ready", every message from the
core ends with its `CoreState`):
    parent -> core   ("add", prompt_ids, params, request_id, arrival_s, prompt_logprobs)
                     ("abort", request_id, status)
                     ("close",)                      stop after the current step
    core -> parent   ("ready", info)                 once, after the engine is built
                     ("error", exc)                  instead, when it could not be built
                     ("step", output_deltas, records, state)   (engine_wire.py)
                     ("failed", request_ids, cause, records, state)   a step's forward raised
                     ("idle", records, state)        commands handled and nothing left to run
Commands are not answered one by one: a reply would cost a whole step of waiting each, and a
burst of k arrivals would be admitted over k steps. The API process validates a prompt before
sending it (so a bad one is a 400 there), and `state.commands_handled` tells it which of its
commands the state already reflects. The core drains every waiting command between two steps
(an abort frees its blocks before the next step) and sleeps in the pipe only when idle.
"""

from __future__ import annotations

import functools
import logging
import pickle
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from splitphase.engine.engine_wire import DeltaEncoder
from splitphase.engine.llm_engine import LLMEngine, StepFailedError

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class CoreState:
    """The core's queues and KV pool right after it sent a message."""

    has_unfinished: bool
    commands_handled: int
    num_running: int
    num_waiting: int
    num_used_blocks: int
    num_blocks: int


def build_engine(model: str, device: str, dtype: str | None,
                 engine_kwargs: dict[str, Any]) -> LLMEngine:
    """The default factory: load `model` and build its engine (in the core process)."""
    from splitphase.engine.llm import LLM  # llm imports the disaggregated engine: only here

    engine = LLM(model, device=device, dtype=dtype, **engine_kwargs).engine
    assert isinstance(engine, LLMEngine), "the engine core runs a local LLMEngine"
    return engine


def engine_factory(model: str, device: str, dtype: str | None,
                   engine_kwargs: dict[str, Any]) -> Callable[[], LLMEngine]:
    """A picklable factory for `run_core` (a spawned process cannot receive a closure)."""
    return functools.partial(build_engine, model, device, dtype, dict(engine_kwargs))


def run_core(conn: Connection, factory: Callable[[], LLMEngine]) -> None:
    """The core process's main: build the engine, then serve the pipe until closed."""
    # The API process owns shutdown (it drains on SIGTERM, then closes the pipe); a Ctrl+C in a
    # terminal reaches the whole process group and must not kill the core mid-drain.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        engine = factory()
    except BaseException as exc:
        conn.send(("error", _picklable(exc)))
        return
    conn.send(("ready", {"max_model_len": int(engine.max_model_len),
                         "vocab_size": int(engine.model.cfg.vocab_size),
                         "kv_pool_blocks": int(engine.kv_pool_blocks),
                         "kv_block_size": int(engine.kv_block_size)}))
    _CoreLoop(conn, engine).run()


class _CoreLoop:
    """Commands between steps, steps back to back while there is work."""

    def __init__(self, conn: Connection, engine: LLMEngine) -> None:
        self.conn, self.engine = conn, engine
        self.closed = False
        self.encoder = DeltaEncoder()
        self.handled = 0  # commands handled so far
        self.reported = 0  # `handled` as of the last message sent

    def run(self) -> None:
        try:
            while not self.closed:
                if not self.engine.has_unfinished_requests():
                    if self.reported < self.handled:  # the parent waits to hear it is idle
                        self._send("idle", self._records())
                    self.conn.poll(None)  # sleep until a command comes
                while not self.closed and self.conn.poll(0):
                    self._handle(self.conn.recv())
                if not self.closed and self.engine.has_unfinished_requests():
                    self._step()
        except (EOFError, BrokenPipeError):  # the API process is gone: nothing to serve
            return

    def _handle(self, msg: tuple[Any, ...]) -> None:
        self.handled += 1
        kind, *args = msg
        if kind == "close":
            self.closed = True
        elif kind == "abort":
            try:
                self.engine.abort_request(*args)
            except Exception:  # the request is gone either way; the others go on
                log.exception("abort of %s failed", args[0])
        elif kind == "add":
            prompt_ids, params, rid, arrival_s, prompt_logprobs = args
            try:
                self.engine.add_request(prompt_ids, params, rid, arrival_s, prompt_logprobs)
            except Exception as exc:  # validated there, so a bug here: fail this request only
                self._send("failed", [rid], _picklable(exc), self._records())
        else:
            raise ValueError(f"the engine core got an unknown command {kind!r}")

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except StepFailedError as exc:  # a failed forward ends its requests; serving goes on
            self._send("failed", exc.request_ids, _picklable(exc.cause), self._records())
            return
        self._send("step", [self.encoder.encode(o) for o in outputs], self._records())

    def _send(self, *msg: Any) -> None:
        self.reported = self.handled
        self.conn.send((*msg, self._state()))

    def _records(self) -> list[Any]:
        """The step records since the last message (the core keeps none: the parent does)."""
        records = list(self.engine.steps)
        self.engine.steps.clear()
        return records

    def _state(self) -> CoreState:
        sched = self.engine.scheduler
        bm = sched.block_manager
        return CoreState(self.engine.has_unfinished_requests(), self.handled, sched.num_running,
                         sched.num_waiting, bm.num_used_blocks, bm.num_blocks)


def _picklable(exc: BaseException) -> BaseException:
    """`exc` if it survives pickling, else a RuntimeError that names it."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(repr(exc))
    return exc


def main(argv: list[str]) -> None:
    """`python -m splitphase.engine.engine_core FD`: serve the connection on inherited fd FD."""
    conn = Connection(int(argv[0]))
    sys.path[:] = conn.recv()  # the parent's, so the factory's module imports here too
    factory = conn.recv()
    run_core(conn, factory)


if __name__ == "__main__":
    # Through the package module: classes pickled from `__main__` would not unpickle there.
    from splitphase.engine import engine_core

    engine_core.main(sys.argv[1:])
