"""The worker loops of a disaggregated pair: commands in, one engine step, records out.

Both roles: handle the front end's commands, run one `LLMEngine` step, report new tokens as
`OutputRecord`s (only tokens not reported before; times relative to arrival, so clocks need
not agree) and the step records. The prefill loop queues handoffs on the KV sender after
reporting the first tokens; the decode loop adopts what the KV receiver queued between steps
and reports the requests it preempted, for the front end to route back to the prefill worker.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from splitphase.engine.disagg_protocol import AddRequest, OutputRecord, WorkerUpdate
from splitphase.engine.kv_transfer import (
    KVReceiver,
    KVSender,
    close_transfer_group,
    empty_kv,
    handoff_from_meta,
    handoff_meta,
)
from splitphase.engine.llm_engine import Handoff, LLMEngine, RequestOutput, StepFailedError

HEARTBEAT_S = 1.0  # control-plane beat while idle, so the front end can tell quiet from dead


def try_send(conn: Connection, msg: object) -> None:
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
    )


def error_record(request_id: str, first_index: int) -> OutputRecord:
    """A request this worker could not serve: finished with reason 'error'."""
    return OutputRecord(request_id, first_index, [], [], [], "", True, "error", None)


def _restore_sampler(engine: LLMEngine, h: Handoff) -> None:
    # LLMEngine.add_prefilled restores the RNG but not the token counts behind presence and
    # frequency penalties; until it does, set them here (the only reach into its internals).
    engine._tracked[h.request.request_id].sampling.output_counts.update(h.request.output_token_ids)


def readmit_preempted(engine: LLMEngine, h: Handoff) -> None:
    """Prefill role: take back a request the decode worker preempted, for a fresh prefill."""
    # LLMEngine has no public entry for this yet (add_prefilled is decode-only); mirror it.
    req = h.request
    t = engine._track(req, req.sampling_params)
    t.sampling.generator.set_state(h.generator_state)
    engine._feed(t, len(req.output_token_ids))
    t.sent_chars, t.sent_tokens = h.sent_chars, h.sent_tokens
    _restore_sampler(engine, h)
    engine.scheduler.add_request(req)  # PREEMPTED: recomputes prompt + outputs, samples next


class WorkerLoop:
    """The worker loop shared by both roles."""

    def __init__(self, conn: Connection, engine: LLMEngine) -> None:
        self.conn, self.engine = conn, engine
        self._sent: dict[str, int] = {}  # output tokens already reported, per request
        self._stop = False
        self._last_report = time.monotonic()
        self._update = WorkerUpdate()

    def run(self) -> None:
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
        close_transfer_group()

    def waitables(self) -> list[Any]:
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
            bm = self.engine.scheduler.block_manager
            self.conn.send(
                (
                    "usage",
                    {
                        "num_blocks": bm.num_free_blocks + bm.num_used_blocks,
                        "num_used_blocks": bm.num_used_blocks,
                        "num_free_blocks": bm.num_free_blocks,
                        "num_running": self.engine.scheduler.num_running,
                        "num_waiting": self.engine.scheduler.num_waiting,
                        "num_pending_kv": len(self.engine.kv_payloads),
                    },
                )
            )
        else:
            self.handle_role(msg)

    def handle_role(self, msg: tuple[Any, ...]) -> None:
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
    def __init__(self, conn: Connection, engine: LLMEngine, sender: KVSender) -> None:
        super().__init__(conn, engine)
        self.sender = sender

    def handle_role(self, msg: tuple[Any, ...]) -> None:
        if msg[0] == "add":
            self._add(msg[1])
        elif msg[0] == "readmit":
            h = handoff_from_meta(msg[1], empty_kv(msg[1]), empty_kv(msg[1]))
            try:
                readmit_preempted(self.engine, h)
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
                _restore_sampler(self.engine, h)
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
