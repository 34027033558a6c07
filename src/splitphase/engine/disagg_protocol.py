"""What a disaggregated pair says to itself: request metadata, output records, clocks (no torch).

Three kinds of traffic, all pickled: the front end's commands to a worker (`("add", AddRequest)`,
`("readmit", meta)`, `("abort", ids)`, `("usage",)`, `("shutdown",)`), a worker's reports to the
front end (`("hello", Hello)`, `("ready", info)`, `("update", WorkerUpdate)`, `("usage", info)`,
`("beat",)`, `("fatal", reason)`, `("peer_lost", reason)`), and the handoff metadata that travels
with K/V from the prefill to the decode worker (`kv_transfer`).

Timestamps are `time.perf_counter()` values of the process that took them. They cross a process
boundary with a `ClockStamp`: on the same boot of the same host CLOCK_MONOTONIC is shared, so
they are used as they are; elsewhere they are shifted by the send time, which drops the transit
time from the one gap that spans it (there is no shared clock to measure it with).
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from splitphase.engine.request import Request, RequestStatus
from splitphase.engine.sampling_params import SamplingParams
from splitphase.errors import UserError

if TYPE_CHECKING:
    from splitphase.engine.llm_engine import StepRecord
    from splitphase.engine.sampler import SampledToken

ROLES = ("prefill", "decode")
AUTHKEY_ENV = "SPLITPHASE_AUTHKEY"  # hex; the front end and both workers must share it


def _read_boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:  # no /proc: never claim a shared clock
        return f"unknown-{uuid.uuid4()}"


BOOT_ID = _read_boot_id()  # a constant of this process: which monotonic clock it reads


@dataclass(frozen=True)
class ClockStamp:
    """Which clock a message's timestamps come from, and when it was sent on that clock."""

    boot_id: str
    sent_s: float

    @classmethod
    def now(cls) -> ClockStamp:
        """A stamp for a message sent now."""
        return cls(BOOT_ID, time.perf_counter())

    def shift_s(self) -> float:
        """Add this to the sender's timestamps to read them on this process's clock."""
        return 0.0 if self.boot_id == BOOT_ID else time.perf_counter() - self.sent_s


@dataclass(frozen=True)
class Hello:
    """A worker's first message: who it is (`session` ties it to one launch of a pair)."""

    role: str
    session: str
    pid: int
    host: str


@dataclass(frozen=True)
class AddRequest:
    """A new request for the prefill worker; the front end has tokenized and validated it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_s: float  # front end clock, see `clock`
    prompt_logprobs: int | None
    clock: ClockStamp


@dataclass
class OutputRecord:
    """What one request produced in one worker step: new tokens only, times relative to arrival."""

    request_id: str
    first_index: int  # position of new_token_ids[0] among the request's output tokens
    new_token_ids: list[int]
    new_token_offsets_s: list[float]  # each token's time minus the arrival time
    new_logprobs: list[SampledToken]  # empty unless logprobs were asked for
    delta: str
    finished: bool
    finish_reason: str | None
    first_scheduled_offset_s: float | None
    num_preemptions: int = 0
    prompt_logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] | None = None
    # Its latest (re)prefill and the prefix-cache hits of that admission, so the front end's
    # Request reads as the worker's (RequestOutput.request); 0: not stated.
    prefill_len: int = 0
    num_cached_tokens: int = 0


@dataclass
class WorkerUpdate:
    """One worker loop iteration's news for the front end."""

    outputs: list[OutputRecord] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    adopted: list[str] = field(default_factory=list)  # decode: now owned here
    preempted: list[dict[str, Any]] = field(default_factory=list)  # decode: handoff metadata

    def __bool__(self) -> bool:
        return bool(self.outputs or self.steps or self.adopted or self.preempted)


_TIME_FIELDS = ("arrival_time_s", "first_scheduled_s", "first_token_s", "finished_s")
_PLAIN_FIELDS = (
    "parent_id",
    "sample_index",
    "num_computed_tokens",
    "prefill_len",
    "num_cached_tokens",
    "num_preemptions",
)


def request_meta(req: Request) -> dict[str, Any]:
    """The fields of a live request that another worker needs to continue it."""
    meta: dict[str, Any] = {name: getattr(req, name) for name in _PLAIN_FIELDS + _TIME_FIELDS}
    meta.update(
        request_id=req.request_id,
        prompt_token_ids=list(req.prompt_token_ids),
        output_token_ids=list(req.output_token_ids),
        sampling_params=req.sampling_params.to_dict(),
        eos_token_id=req.eos_token_id,
        status=req.status.value,
        token_times_s=list(req.token_times_s),
    )
    return meta


def request_from_meta(meta: dict[str, Any], shift_s: float) -> Request:
    """Rebuild a request on this process's clock (`ClockStamp.shift_s`)."""
    req = Request(
        meta["request_id"],
        meta["prompt_token_ids"],
        SamplingParams(**meta["sampling_params"]),
        meta["arrival_time_s"] + shift_s,
        meta["eos_token_id"],
    )
    for name in _PLAIN_FIELDS:
        setattr(req, name, meta[name])
    for name in _TIME_FIELDS[1:]:
        value = meta[name]
        setattr(req, name, None if value is None else value + shift_s)
    req.output_token_ids = list(meta["output_token_ids"])
    req.token_times_s = [t + shift_s for t in meta["token_times_s"]]
    req.status = RequestStatus(meta["status"])
    return req


def parse_host_port(address: str, what: str) -> tuple[str, int]:
    """'HOST:PORT' -> (host, port), with an error that names the option."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise UserError(f"{what} must be HOST:PORT (e.g. 10.0.0.1:7100), got {address!r}")
    return host.strip("[]"), int(port)


def without_nagle(conn: Connection) -> Connection:
    """Set TCP_NODELAY on a control connection (both ends call this on theirs).

    A worker sends one small update per step and the front end never answers it, so with
    Nagle's algorithm each update waits for the ACK of the one before, which the receiver
    delays up to ~40 ms: decode tokens reached the front end in bursts, 6-40 ms late. A Unix
    socket (no TCP) is left as it is.
    """
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn
