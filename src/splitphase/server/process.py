"""Start `splitphase serve` in a child process on a free port and wait until it is healthy.

For tests and benchmarks: `with ServerProcess(["--model", path]) as url: ...` stops the
server with SIGTERM (a graceful drain) on exit and kills it if it does not stop in time.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from types import TracebackType

import httpx


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """A server child process; `url` once `start()` returned."""

    def __init__(self, args: Sequence[str], host: str = "127.0.0.1", port: int | None = None,
                 env: dict[str, str] | None = None, startup_timeout_s: float = 120.0) -> None:
        self.host, self.port = host, port or free_port(host)
        self.args = list(args)
        self.env = {**os.environ, **(env or {})}
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the child

    @property
    def url(self) -> str:
        """Base URL, without /v1."""
        return f"http://{self.host}:{self.port}"

    def start(self) -> str:
        """Launch and wait for `/health` to answer 200; raises with the log tail if it dies."""
        cmd = [sys.executable, "-m", "splitphase.cli", "serve", "--host", self.host,
               "--port", str(self.port), *self.args]
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server not healthy after {self.startup_timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        """Everything the server printed so far."""
        self._log.flush()
        self._log.seek(0)
        return self._log.read().decode("utf-8", "replace")

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM, wait, then SIGKILL; returns the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(5)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
        self._log.close()
