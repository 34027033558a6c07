"""A worker process of a disaggregated pair: connect, build the engine, loop.

`run_worker` dials the front end, loads the model, joins the process group and runs the loop.

Both roles: handle the front end's commands, run one `LLMEngine` step, report new tokens as
`OutputRecord`s (only tokens not reported before; times relative to arrival, so clocks need
not agree) and the step records. The prefill loop queues handoffs on the KV sender after
reporting the first tokens; the decode loop adopts what the KV receiver queued between steps
and reports the requests it preempted, for the front end to route back to the prefill worker.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
import traceback
from multiprocessing.connection import Client, Connection, wait
from typing import Any

import torch

from splitphase.engine.config import EngineConfig
from splitphase.engine.disagg_protocol import (
    AUTHKEY_ENV,
    ROLES,
    AddRequest,
    Hello,
    OutputRecord,
    WorkerUpdate,
    parse_host_port,
    without_nagle,
)
from splitphase.engine.disagg_worker import WorkerOptions
from splitphase.engine.kv_transfer import (
    KVReceiver,
    KVSender,
    close_transfer_group,
    empty_kv,
    handoff_from_meta,
    handoff_meta,
    init_transfer_group,
    resolve_backend,
)
from splitphase.engine.llm_engine import LLMEngine, RequestOutput, StepFailedError
from splitphase.errors import UserError
from splitphase.model.checkpoint import load_model, load_tokenizer

HEARTBEAT_S = 1.0  # control-plane beat while idle, so the front end can tell quiet from dead


def try_send(conn: Connection, msg: object) -> None:
    """Send if the connection is still open (a last word to a front end that may be gone)."""
    with contextlib.suppress(OSError):
        conn.send(msg)


def make_record(out: RequestOutput, sent: int) -> OutputRecord:
    """An output's tokens from index `sent` on, timed relative to the request's arrival."""
    req = out.request
    assert req is not None  # LLMEngine always attaches its request
    new = out.token_ids[sent:]
    times = req.token_times_s[sent : len(out.token_ids)]
    scheduled = req.first_scheduled_s
    return OutputRecord(
        out.request_id,
        sent,
        list(new),
        [t - req.arrival_time_s for t in times],
        list(out.logprobs[len(out.logprobs) - len(new) :]) if out.logprobs and new else [],
        out.delta,
        out.finished,
        out.finish_reason,
        None if scheduled is None else scheduled - req.arrival_time_s,
        req.num_preemptions,
        out.prompt_logprobs if sent == 0 else None,
        prefill_len=req.prefill_len,
        num_cached_tokens=req.num_cached_tokens,
    )


def error_record(request_id: str, first_index: int) -> OutputRecord:
    """A request this worker could not serve: finished with reason 'error'."""
    return OutputRecord(request_id, first_index, [], [], [], "", True, "error", None)


class WorkerLoop:
    """The worker loop shared by both roles."""

    def __init__(self, conn: Connection, engine: LLMEngine) -> None:
        self.conn, self.engine = conn, engine
        self._sent: dict[str, int] = {}  # output tokens already reported, per request
        self._stop = False
        self._last_report = time.monotonic()
        self._update = WorkerUpdate()

    def run(self) -> None:
        """Serve until told to stop; EOFError when the front end goes away."""
        while not self._stop:
            busy = self.engine.has_unfinished_requests()
            self._poll(0.0 if busy else HEARTBEAT_S)
            if self._stop:
                break
            self.before_step()
            if self.engine.has_unfinished_requests():
                self._step()
            self.after_step()
            self._report()

    def close(self) -> None:
        """Leave the process group."""
        close_transfer_group()

    def waitables(self) -> list[Any]:
        """What the idle wait wakes up for."""
        return [self.conn]

    def _poll(self, timeout_s: float) -> None:
        ready = wait(self.waitables(), timeout_s)
        self.on_wake(ready)
        while not self._stop and self.conn.poll():
            self._handle(self.conn.recv())

    def on_wake(self, ready: list[Any]) -> None:
        """Hook: a waitable other than the control connection became ready."""

    def _handle(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "shutdown":
            self._stop = True
        elif kind == "abort":
            for rid in msg[1]:
                self.engine.abort_request(rid)
        elif kind == "usage":
            self.conn.send(("usage", self.usage()))
        else:
            self.handle_role(msg)

    def usage(self) -> dict[str, int]:
        """KV blocks and queues of this worker, for the front end's `block_usage()`."""
        bm, sched = self.engine.scheduler.block_manager, self.engine.scheduler
        return {
            "num_blocks": bm.num_free_blocks + bm.num_used_blocks,
            "num_used_blocks": bm.num_used_blocks,
            "num_free_blocks": bm.num_free_blocks,
            "num_running": sched.num_running,
            "num_waiting": sched.num_waiting,
            "num_pending_kv": len(self.engine.kv_payloads),
        }

    def handle_role(self, msg: tuple[Any, ...]) -> None:
        """Hook: commands only one role takes."""
        raise ValueError(f"unknown command {msg[0]!r}")

    def before_step(self) -> None:
        """Hook: work between commands and the step."""

    def after_step(self) -> None:
        """Hook: move handoffs out after the step."""

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except StepFailedError as exc:  # the engine ended those requests; report them
            traceback.print_exc()
            for rid in exc.request_ids:
                self._update.outputs.append(error_record(rid, self._sent.pop(rid, 0)))
            return
        for out in outputs:
            rid = out.request_id
            self._update.outputs.append(make_record(out, self._sent.get(rid, 0)))
            self._sent[rid] = len(out.token_ids)
            if out.finished:
                del self._sent[rid]
        self._update.steps.extend(self.engine.steps)
        self.engine.steps.clear()  # the front end keeps them

    def _report(self) -> None:
        now = time.monotonic()
        if self._update:
            self.conn.send(("update", self._update))
            self._update = WorkerUpdate()
        elif now - self._last_report >= HEARTBEAT_S:
            self.conn.send(("beat",))
        else:
            return
        self._last_report = now


class PrefillLoop(WorkerLoop):
    """Prompts in; first tokens to the front end, K/V to the decode worker."""

    def __init__(self, conn: Connection, engine: LLMEngine, sender: KVSender) -> None:
        super().__init__(conn, engine)
        self.sender = sender

    def handle_role(self, msg: tuple[Any, ...]) -> None:
        if msg[0] == "add":
            self._add(msg[1])
        elif msg[0] == "readmit":
            h = handoff_from_meta(msg[1], empty_kv(msg[1]), empty_kv(msg[1]))
            try:
                self.engine.readmit_preempted(h)
                self._sent[h.request.request_id] = h.sent_tokens
            except Exception as exc:
                print(f"readmit of {h.request.request_id} failed: {exc!r}", file=sys.stderr)
                self._update.outputs.append(error_record(h.request.request_id, h.sent_tokens))
        else:
            super().handle_role(msg)

    def _add(self, a: AddRequest) -> None:
        try:
            self.engine.add_request(
                a.prompt_token_ids,
                a.params,
                a.request_id,
                a.arrival_s + a.clock.shift_s(),
                a.prompt_logprobs,
            )
        except Exception as exc:  # the front end validated; this is a mismatch of limits
            print(f"add of {a.request_id} failed: {exc!r}", file=sys.stderr)
            self._update.outputs.append(error_record(a.request_id, 0))

    def before_step(self) -> None:
        if self.sender.error is not None:
            raise RuntimeError(f"KV transfer to the decode worker failed: {self.sender.error}")

    def after_step(self) -> None:
        handoffs = self.engine.pop_handoffs()
        if handoffs:
            self._report()  # first tokens reach the front end before the decode side's
        for h in handoffs:
            self._sent.pop(h.request.request_id, None)
            self.sender.put(h)

    def close(self) -> None:
        if self.sender.error is None:
            self.sender.close()  # the close header lets the receiver stop cleanly
        super().close()


class DecodeLoop(WorkerLoop):
    """Handoffs in from the KV receiver; decode tokens to the front end."""

    def __init__(self, conn: Connection, engine: LLMEngine, wire: torch.device) -> None:
        super().__init__(conn, engine)
        self._wake_r, self._wake_w = socket.socketpair()
        self.receiver = KVReceiver(wire, lambda: _try_wake(self._wake_w))
        self._peer_reported = False

    def waitables(self) -> list[Any]:
        return [self.conn, self._wake_r]

    def on_wake(self, ready: list[Any]) -> None:
        if self._wake_r in ready:
            self._wake_r.recv(4096)

    def before_step(self) -> None:
        for h in self.receiver.drain():
            rid = h.request.request_id
            try:
                self.engine.add_prefilled(h)
            except Exception as exc:
                print(f"adopting {rid} failed: {exc!r}", file=sys.stderr)
                self._update.outputs.append(error_record(rid, h.sent_tokens))
                continue
            self._sent[rid] = h.sent_tokens
            self._update.adopted.append(rid)
        err = self.receiver.error
        if err is not None and not self._peer_reported:
            # Keep decoding what is here; the front end stops routing to this pair.
            self._peer_reported = True
            self.conn.send(("peer_lost", f"KV receive from the prefill worker failed: {err}"))

    def after_step(self) -> None:
        for h in self.engine.pop_handoffs():  # preempted here: prefill them again over there
            self._sent.pop(h.request.request_id, None)
            self._update.preempted.append(handoff_meta(h))

    def close(self) -> None:
        if self.receiver.join(2.0):
            super().close()
        # else a recv is still blocked on a silent peer: leave the group to process exit
        self._wake_r.close()
        self._wake_w.close()


def _try_wake(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.send(b"x")


def _authkey() -> bytes:
    key = os.environ.get(AUTHKEY_ENV, "")
    with contextlib.suppress(ValueError):
        if key:
            return bytes.fromhex(key)
    raise UserError(f"${AUTHKEY_ENV} must hold the front end's key in hex, got {key!r}")


def _connect(address: str, key: bytes, timeout_s: float) -> Connection:
    """Dial the front end, retrying while it is not listening yet (start order is free)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return without_nagle(Client(parse_host_port(address, "--control"), authkey=key))
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise UserError(
                    f"nothing listens at --control {address} after {timeout_s:.0f} s;"
                    " start the front end there (or fix the address)"
                ) from None
            time.sleep(0.5)


def run_worker(opts: WorkerOptions) -> int:
    """Connect, load, join the process group, serve; returns the exit code."""
    key = _authkey()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    conn = _connect(opts.control, key, opts.timeout_s)
    conn.send(("hello", Hello(opts.role, opts.session, os.getpid(), socket.gethostname())))
    loop: WorkerLoop | None = None
    try:
        loop = _build(opts, conn)
        loop.run()
        return 0
    except (KeyboardInterrupt, EOFError, BrokenPipeError):
        return 0  # Ctrl-C, or the front end went away: nothing left to serve
    except BaseException as exc:
        traceback.print_exc()
        try_send(conn, ("fatal", f"{exc!r}"))
        return 1
    finally:
        if loop is not None:
            loop.close()
        conn.close()


def _build(opts: WorkerOptions, conn: Connection) -> WorkerLoop:
    device = torch.device(opts.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = load_model(opts.model, device=device, dtype=opts.dtype)
    tokenizer = load_tokenizer(opts.model, opts.tokenizer)
    cfg = EngineConfig(policy="disaggregated", role=opts.role, **opts.engine)
    engine = LLMEngine(model, tokenizer, cfg)
    backend = resolve_backend(opts.backend, device)
    init_transfer_group(opts.dist_init, ROLES.index(opts.role), backend, opts.timeout_s)
    wire = device if backend == "nccl" else torch.device("cpu")
    conn.send(
        (
            "ready",
            {
                "max_model_len": engine.max_model_len,
                "vocab_size": model.cfg.vocab_size,
                "num_blocks": engine.cache.num_blocks,
                "block_size": engine.cache.block_size,
                "backend": backend,
            },
        )
    )
    if opts.role == "prefill":
        return PrefillLoop(conn, engine, KVSender(wire, opts.timeout_s))
    return DecodeLoop(conn, engine, wire)
