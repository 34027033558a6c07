"""Run the app under uvicorn with a graceful SIGTERM.

The first SIGTERM (or Ctrl+C) starts a drain: the port stays open so new requests get a clean
503 (and /health fails, so a load balancer stops routing here), in-flight requests run to the
end, and uvicorn stops once none is left. Past `shutdown_timeout_s` (or at a second signal)
the requests still in flight end with a 503 error (an SSE `error` event then `[DONE]`, never a
stream cut mid-event) and the server stops once those are written (or CUT_GRACE_S later). A
third signal stops at once.
"""

from __future__ import annotations

import logging
import socket
import time
from types import FrameType

import uvicorn
from fastapi import FastAPI

from splitphase.errors import UserError
from splitphase.server.state import ServerState

log = logging.getLogger("splitphase.server")
CUT_GRACE_S = 2.0  # after the drain timeout: time for the 503 error events to be written


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first exit signal drains instead of stopping."""

    def __init__(self, config: uvicorn.Config, state: ServerState, timeout_s: float) -> None:
        super().__init__(config)
        self.state, self.timeout_s = state, timeout_s
        self._deadline_s: float | None = None
        self._cut_s: float | None = None  # when in-flight requests were ended with an error
        self._why = f"its drain timeout of {timeout_s:g} s passed"
        self._signals = 0

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Signal context: only set flags. Not recorded in _captured_signals, so uvicorn does not
        # re-raise it after the drain and the process exits 0.
        self._signals += 1
        if self._signals == 1:
            self._deadline_s = time.monotonic() + self.timeout_s
            self.state.begin_drain()
        elif self._signals == 2:  # the next tick ends in-flight requests with a 503
            self._deadline_s = time.monotonic()
            self._why = "a second shutdown signal"
        else:  # a third stops now, without waiting for connections
            self.should_exit = True
            self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self._deadline_s is not None and not self.should_exit:
            if self.state.in_flight == 0:
                log.info("drained: shutting down")
                self.should_exit = True
            elif self._cut_s is None and time.monotonic() > self._deadline_s:
                # Their streams end with an error event and [DONE], not a cut connection.
                log.warning("shutdown timeout: %d sequences still in flight end with 503",
                            self.state.in_flight)
                self.state.cut_in_flight(self._why)
                self._cut_s = time.monotonic()
            elif self._cut_s is not None and time.monotonic() > self._cut_s + CUT_GRACE_S:
                log.warning("%d sequences did not end after the 503; cutting",
                            self.state.in_flight)
                self.should_exit = True
        return await super().on_tick(counter)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket, or a one-line error when the address is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP: asyncio only sets TCP_NODELAY on accepted sockets whose proto is
    # IPPROTO_TCP, and a socket made with proto 0 keeps Nagle on. With Nagle, a streamed chunk
    # waits for the ACK of the previous one, which a keep-alive client delays by ~40 ms, so
    # every SSE chunk of a short stream arrived at once, ~40 ms late. Set it on the listener too
    # (accepted sockets inherit it on Linux).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port} ({exc.strerror}); pick another "
                        "--port or stop what is using it") from exc
    sock.set_inheritable(True)
    return sock


def run(app: FastAPI, sock: socket.socket, shutdown_timeout_s: float,
        log_level: str = "info") -> None:
    """Serve until drained after SIGTERM (blocks)."""
    state: ServerState = app.state.splitphase
    config = uvicorn.Config(app, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=5, log_config=None)
    server = DrainingServer(config, state, shutdown_timeout_s)
    server.run(sockets=[sock])
