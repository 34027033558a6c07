"""Serve an app under uvicorn on a thread of this process (loopback only), for fault tests.

In-process, a test can patch the model runner (a forward that raises, or sleeps) and read the
scheduler directly, while clients still go through real sockets and real HTTP.
"""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType

import uvicorn
from fastapi import FastAPI

from splitphase.server.launch import bind


class InProcessServer:
    """`with InProcessServer(app) as url:` serves `app` on 127.0.0.1 until the block ends."""

    def __init__(self, app: FastAPI, startup_timeout_s: float = 30.0,
                 sndbuf_bytes: int | None = None) -> None:
        self.app = app
        self.sock = bind("127.0.0.1", 0)  # the server's own listener: TCP_NODELAY included
        if sndbuf_bytes is not None:
            # Accepted connections inherit it (and lose autotuning): a slow reader then fills
            # the server's buffers after kilobytes, as over a real network, not megabytes.
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf_bytes)
        self.port = int(self.sock.getsockname()[1])
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                access_log=False, log_config=None, timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.startup_timeout_s = startup_timeout_s
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Base URL, without /v1."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> str:
        """Start serving; returns the URL once uvicorn listens."""
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                        name="uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self.startup_timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.01)
        return self.url

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask uvicorn to exit (the app's lifespan stops the engine) and wait."""
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.sock.close()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
