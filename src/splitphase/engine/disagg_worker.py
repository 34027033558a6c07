"""One worker of a disaggregated pair: `splitphase worker --role prefill|decode ...`.

A worker connects to the front end's control address (multiprocessing.connection, TCP, the
shared key in $SPLITPHASE_AUTHKEY), loads its model, joins the two-rank process group at
`--dist-init` (the prefill worker, rank 0, hosts it), says `ready`, then loops: handle commands,
(decode) adopt handoffs the receiver thread queued, run one engine step, report outputs.

- prefill: runs prompts; a request whose first token is out leaves by `pop_handoffs()` and
  its K/V goes to the KV sender thread. Requests the decode worker preempted come back as
  `readmit` and are prefilled again (prompt + outputs so far), keeping their sampler state.
- decode: adopts handoffs between steps (`LLMEngine.add_prefilled`) and decodes; a request it
  preempts goes back to the front end, which routes it to the prefill worker.

A worker exits when told to, when the front end's connection closes, or on an error it cannot
serve through (reported first as `fatal`). See `splitphase.engine.disagg` for the whole pair.
This module holds the options and the entry points and imports no torch, so `splitphase --help`
stays fast; the worker process itself is `disagg_loops.run_worker`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from splitphase.engine.config import EngineConfig
from splitphase.engine.disagg_protocol import ROLES
from splitphase.errors import UserError

ENGINE_FIELDS = tuple(f.name for f in fields(EngineConfig) if f.name not in ("policy", "role"))


def _phases(text: str) -> tuple[str, ...]:
    return tuple(p for p in text.split(",") if p)


# How a worker's command line spells the engine fields that are not integers (to_argv joins
# a tuple with commas).
_FIELD_TYPES: dict[str, Any] = {"kv_memory_fraction": float, "kv_cache_dtype": str,
                                "compile": _phases}


@dataclass(frozen=True)
class WorkerOptions:
    """How to start one worker; `to_argv()` is its `splitphase worker` command line."""

    role: str
    model: str  # embedded name or checkpoint directory
    control: str  # HOST:PORT where the front end listens
    dist_init: str  # tcp://HOST:PORT of the process group (the prefill worker's host)
    device: str = "cpu"
    dtype: str | None = None
    tokenizer: str | None = None  # a directory with tokenizer.json; default: the model's own
    backend: str = "auto"
    timeout_s: float = 60.0
    threads: int | None = None  # torch intra-op threads
    session: str = ""  # ties the worker to one launch of a pair
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields (no policy/role)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise UserError(f"--role must be one of {ROLES}, got {self.role!r}")
        unknown = sorted(set(self.engine) - set(ENGINE_FIELDS))
        if unknown:
            raise UserError(f"unknown engine options {unknown}; known: {list(ENGINE_FIELDS)}")
        if not self.timeout_s > 0:
            raise UserError(f"--timeout must be > 0 seconds, got {self.timeout_s}")

    def to_argv(self) -> list[str]:
        """Command-line arguments that `options_from_args(parse)` turns back into these options."""
        argv = [
            "--role",
            self.role,
            "--model",
            self.model,
            "--control",
            self.control,
            "--dist-init",
            self.dist_init,
            "--device",
            self.device,
            "--backend",
            self.backend,
            "--timeout",
            str(self.timeout_s),
        ]
        for flag, value in (
            ("--dtype", self.dtype),
            ("--tokenizer", self.tokenizer),
            ("--threads", self.threads),
            ("--session", self.session or None),
        ):
            if value is not None:
                argv += [flag, str(value)]
        for name, value in self.engine.items():
            if name == "enable_prefix_caching":
                argv += [] if value else ["--no-prefix-caching"]
            elif value is not None:
                text = ",".join(value) if isinstance(value, tuple | list) else str(value)
                argv += ["--" + name.replace("_", "-"), text]
        return argv


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `splitphase worker` (wire as a subcommand calling `worker_command`)."""
    p.add_argument("--role", required=True, choices=ROLES)
    p.add_argument("--model", required=True, help="embedded model name or checkpoint dir")
    p.add_argument("--control", required=True, help="HOST:PORT where the front end listens")
    p.add_argument("--dist-init", required=True, help="tcp://HOST:PORT on the prefill host")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--tokenizer", default=None, help="dir with tokenizer.json (default: model's)")
    p.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    p.add_argument("--timeout", type=float, default=60.0, help="transfer timeout, seconds")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--session", default="", help=argparse.SUPPRESS)
    for name in ENGINE_FIELDS:
        if name == "enable_prefix_caching":
            p.add_argument("--no-prefix-caching", action="store_true")
        else:
            p.add_argument("--" + name.replace("_", "-"), type=_FIELD_TYPES.get(name, int),
                           default=None)


def options_from_args(args: argparse.Namespace) -> WorkerOptions:
    """Parsed `splitphase worker` arguments -> WorkerOptions."""
    engine = {
        n: getattr(args, n)
        for n in ENGINE_FIELDS
        if n != "enable_prefix_caching" and getattr(args, n) is not None
    }
    if args.no_prefix_caching:
        engine["enable_prefix_caching"] = False
    return WorkerOptions(
        args.role,
        args.model,
        args.control,
        args.dist_init,
        args.device,
        args.dtype,
        args.tokenizer,
        args.backend,
        args.timeout,
        args.threads,
        args.session,
        engine,
    )


def worker_command(args: argparse.Namespace) -> None:
    """`splitphase worker`: run one worker until the front end shuts it down."""
    from splitphase.engine.disagg_loops import run_worker  # torch: only when a worker runs

    code = run_worker(options_from_args(args))
    if code:
        raise SystemExit(code)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m splitphase.engine.disagg_worker ...` (how the front end launches workers)."""
    p = argparse.ArgumentParser(prog="splitphase worker", description=__doc__.splitlines()[0])
    add_worker_arguments(p)
    from splitphase.engine.disagg_loops import run_worker

    try:
        return run_worker(options_from_args(p.parse_args(argv)))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is closed by now; interpreter teardown with torch and a gloo group costs ~1 s
    # per shutdown and can block on a recv still pending on a silent peer.
    os._exit(code)
