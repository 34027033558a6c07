"""The front end's side of the control plane: a listener the workers dial, and local launches.

`multiprocessing.connection` over TCP with an HMAC authkey, so a worker on another host can dial
in. `Listener.accept()` has no timeout, so a thread accepts and hands connections over a queue;
a worker that dies before dialing then costs a timeout, never a hang.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Listener
from typing import Any

from splitphase.engine.disagg_protocol import AUTHKEY_ENV, ROLES, Hello, without_nagle
from splitphase.engine.disagg_worker import WorkerOptions
from splitphase.errors import UserError
from splitphase.model.tokenizer import Tokenizer


class WorkerStartError(RuntimeError):
    """The worker pair did not come up; the message says which worker and why."""


@dataclass
class WorkerHandle:
    """The front end's view of one worker: its connection, process (if local) and news."""

    role: str
    conn: Connection
    proc: subprocess.Popen[bytes] | None
    info: dict[str, Any]
    hello: Hello
    last_heard_s: float = field(default_factory=time.monotonic)
    usage: dict[str, int] | None = None  # reply to the latest usage query

    @property
    def pid(self) -> int:
        """The worker's process id, on its own host."""
        return self.hello.pid


class ControlServer:
    """Listens for worker connections; `next_connection` waits with a timeout."""

    def __init__(self, host: str, port: int, authkey: bytes) -> None:
        self._listener = Listener((host, port), family="AF_INET", authkey=authkey)
        self.address: tuple[str, int] = self._listener.address
        self._queue: queue.Queue[Connection] = queue.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="control-accept", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except (OSError, EOFError):
                continue  # a failed handshake (wrong key, a port scan) or our own wake-up
            if self._closed:
                conn.close()
                return
            self._queue.put(without_nagle(conn))

    def next_connection(self, timeout_s: float) -> Connection | None:
        """The next authenticated worker connection, or None after timeout_s."""
        try:
            return self._queue.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def close(self) -> None:
        """Stop accepting and close the listening socket."""
        if self._closed:
            return
        self._closed = True
        host = "127.0.0.1" if self.address[0] in ("0.0.0.0", "") else self.address[0]
        # Wake the blocked accept(): its handshake fails and the thread sees _closed.
        with contextlib.suppress(OSError):
            socket.create_connection((host, self.address[1]), timeout=1.0).close()
        self._thread.join(2.0)
        self._listener.close()
        while (conn := self.next_connection(0.0)) is not None:
            conn.close()


def resolve_authkey(spawn_workers: bool) -> bytes:
    """$SPLITPHASE_AUTHKEY, or a fresh key for workers we start (they get it by environment)."""
    key = os.environ.get(AUTHKEY_ENV, "")
    try:
        if key:
            return bytes.fromhex(key)
    except ValueError:
        raise UserError(f"${AUTHKEY_ENV} must be hex, got {key!r}") from None
    if not spawn_workers:
        raise UserError(f"set ${AUTHKEY_ENV} (hex) to the key the workers will use")
    return secrets.token_bytes(32)


def free_port(host: str) -> int:
    """A TCP port that is free now on `host` (the process group's store binds it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def spawn_worker(opts: WorkerOptions, authkey: bytes) -> subprocess.Popen[bytes]:
    """Start one worker process on this host (stdout/stderr go to ours)."""
    env = dict(os.environ)
    env[AUTHKEY_ENV] = authkey.hex()  # the environment, not argv: ps shows argv to everyone
    if opts.threads:
        env["OMP_NUM_THREADS"] = str(opts.threads)
    argv = [sys.executable, "-m", "splitphase.engine.disagg_worker", *opts.to_argv()]
    return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL)


def describe_exit(code: int) -> str:
    """'exited with code 1' or 'was killed by SIGKILL'."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def stop_processes(procs: list[subprocess.Popen[bytes]], grace_s: float) -> None:
    """Wait up to grace_s for the processes to exit, then kill and reap the rest."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def await_workers(
    server: ControlServer, session: str, procs: dict[str, subprocess.Popen[bytes]], timeout_s: float
) -> dict[str, WorkerHandle]:
    """Accept one prefill and one decode worker and wait until both say `ready`."""
    deadline = time.monotonic() + timeout_s
    pending: dict[str, tuple[Connection, Hello]] = {}
    ready: dict[str, WorkerHandle] = {}
    while len(ready) < len(ROLES):
        if time.monotonic() > deadline:
            missing = sorted(set(ROLES) - set(ready))
            raise WorkerStartError(
                f"the {' and '.join(missing)} worker(s) were not ready after {timeout_s:.0f} s;"
                " check they run, reach the control address and share $SPLITPHASE_AUTHKEY"
            )
        for role, proc in procs.items():
            code = proc.poll()
            if code is not None and role not in ready:
                raise WorkerStartError(
                    f"the {role} worker {describe_exit(code)} while starting (its error is on"
                    " stderr above)"
                )
        conn = server.next_connection(0.05)
        if conn is not None:
            _greet(conn, session, pending, ready)
        for role, (c, hello) in list(pending.items()):
            if c.poll():
                ready[role] = _on_ready(role, c, hello, procs.get(role))
                del pending[role]
    return ready


def _greet(
    conn: Connection,
    session: str,
    pending: dict[str, tuple[Connection, Hello]],
    ready: dict[str, WorkerHandle],
) -> None:
    msg = conn.recv() if conn.poll(5.0) else None
    hello = msg[1] if isinstance(msg, tuple) and msg[0] == "hello" else None
    if not isinstance(hello, Hello) or hello.session != session:
        conn.close()  # a worker of an earlier pair, or not a worker at all
        return
    if hello.role in pending or hello.role in ready:
        conn.close()
        raise WorkerStartError(f"two {hello.role} workers dialed in; start exactly one of each")
    pending[hello.role] = (conn, hello)


def _on_ready(
    role: str, conn: Connection, hello: Hello, proc: subprocess.Popen[bytes] | None
) -> WorkerHandle:
    try:
        msg = conn.recv()
    except (EOFError, OSError) as exc:
        raise WorkerStartError(f"the {role} worker hung up while starting ({exc!r})") from exc
    if msg[0] == "fatal":
        raise WorkerStartError(f"the {role} worker failed while starting: {msg[1]}")
    if msg[0] != "ready":
        raise WorkerStartError(f"the {role} worker sent {msg[0]!r} before 'ready'")
    return WorkerHandle(role, conn, proc, msg[1], hello)


def save_tokenizer(tokenizer: Tokenizer, out_dir: str) -> None:
    """tokenizer.json plus bos/eos, so workers decode and stop exactly as the front end."""
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    special = {
        name: tokenizer.hf.id_to_token(i)
        for name, i in (
            ("bos_token", tokenizer.bos_token_id),
            ("eos_token", tokenizer.eos_token_id),
        )
        if i is not None
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(special, f)


def cleanup(
    procs: list[Any], server: ControlServer, owned: tempfile.TemporaryDirectory[str] | None
) -> None:
    """Kill local workers still running, stop listening, remove the temporary checkpoint."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    server.close()
    if owned is not None:
        owned.cleanup()
