"""`splitphase serve`: the OpenAI-compatible server on FastAPI + uvicorn."""

from __future__ import annotations

import logging
import os
from dataclasses import replace

from splitphase.errors import UserError
from splitphase.server.config import ServerConfig

API_KEY_ENV = "SPLITPHASE_API_KEY"  # keeps the key out of `ps` output


def serve(config: ServerConfig, host: str, port: int, log_level: str = "info") -> None:
    """Bind, load the model, serve until SIGTERM has drained the in-flight requests."""
    from splitphase.server.app import create_app
    from splitphase.server.launch import bind, run

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s")
    if config.api_key is None and os.environ.get(API_KEY_ENV):
        config = replace(config, api_key=os.environ[API_KEY_ENV])
    if not 0 <= port <= 65535:
        raise UserError(f"--port must be in [0, 65535], got {port}")
    sock = bind(host, port)  # fail on a taken port before spending seconds on the model
    try:
        app = create_app(config)
    except BaseException:
        sock.close()
        raise
    state = app.state.splitphase
    log = logging.getLogger("splitphase.server")
    log.info("serving %r (policy %s, max_model_len %d, %s) on http://%s:%d",
             config.model_id, config.policy, state.max_model_len,
             "API key required" if config.api_key else "no API key", host,
             sock.getsockname()[1])
    run(app, sock, config.shutdown_timeout_s, log_level)
