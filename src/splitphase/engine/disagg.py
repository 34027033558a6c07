"""Disaggregated serving: prefill and decode in two worker processes, on one host or two.

    front end (DisaggregatedEngine)  --control plane: add / abort / usage / shutdown-->  workers
        ^  first tokens (prefill) and later deltas (decode) as OutputRecords  |
    prefill worker (rank 0) --torch.distributed send/recv: header, metadata, K, V--> decode (rank 1)

The front end tokenizes and validates, keeps a mirror `Request` per request (tokens, text and
timestamps on its own clock, so `RequestOutput.request` carries queue_s, prefill_s, ttft_s,
decode_s, tpot_s and inter_token_s as `LLMEngine` outputs do), and routes: new requests to the
prefill worker; requests the decode worker preempts back to the prefill worker, which prefills
prompt + outputs again and hands them over once more (sampler state kept, so greedy and seeded
outputs equal a colocated run). It is single-threaded, like LLMEngine: `step()` waits up to
`poll_s` for worker news and returns what arrived.

Two machines (A: front end and prefill worker; B: decode worker). Every process needs the same
key in $SPLITPHASE_AUTHKEY (e.g. `export SPLITPHASE_AUTHKEY=$(openssl rand -hex 32)`):

    A$ python  # or the server, with AsyncEngine(engine)
    >>> cfg = DisaggConfig(model="small", spawn_workers=False, host="0.0.0.0", control_port=7100)
    >>> engine = DisaggregatedEngine(cfg)  # waits (startup_timeout_s) for both workers
    A$ splitphase worker --role prefill --model small --control A:7100 --dist-init tcp://A:29500
    B$ splitphase worker --role decode --model small --control A:7100 --dist-init tcp://A:29500

`--dist-init` names the prefill host (rank 0 hosts the process group's TCP store); both workers
must agree on --backend (auto: nccl on CUDA, gloo on CPU) and on the model. Open ports 7100 and
29500 plus gloo/nccl's ephemeral ports between A and B, and set GLOO_SOCKET_IFNAME (or
NCCL_SOCKET_IFNAME) if the hosts have several interfaces. `restart()` in this mode waits for a
fresh pair to dial in; start them again with a new --dist-init port.

Failures surface as `StepFailedError(request_ids, WorkerDiedError)` from `step()` (AsyncEngine
turns it into an error on each stream), within a poll: a worker process that exits, a control
connection that closes, a worker that reports a fatal error or a lost KV peer, or silence longer
than `timeout_s`. A dead decode worker fails every in-flight request (all of them were headed
there); a dead prefill worker fails those it held, and the decode worker finishes the rest.
The pair is then broken: `add_request` raises WorkerDiedError until `restart()`.

In-memory models: the workers load a model by name or path, so `launch(model=<Transformer>)`
saves it (and the tokenizer) to a temporary checkpoint that `close()` removes.
"""

from __future__ import annotations

import itertools
import secrets
import tempfile
import time
import weakref
from dataclasses import asdict
from multiprocessing.connection import Connection, wait
from typing import Any, cast

from splitphase.engine.disagg_config import DisaggConfig, WorkerDiedError, WorkerStepRecord
from splitphase.engine.disagg_control import (
    ControlServer,
    WorkerHandle,
    WorkerStartError,
    await_workers,
    cleanup,
    describe_exit,
    free_port,
    resolve_authkey,
    save_tokenizer,
    spawn_worker,
    stop_processes,
)
from splitphase.engine.disagg_frontend import FrontendState
from splitphase.engine.disagg_protocol import ROLES, AddRequest, ClockStamp
from splitphase.engine.disagg_worker import WorkerOptions
from splitphase.engine.llm_engine import RequestOutput, StepFailedError, StepRecord
from splitphase.engine.request import RequestStatus, validate_prompt
from splitphase.engine.sampling_params import SamplingParams
from splitphase.errors import UserError
from splitphase.model.checkpoint import (
    load_tokenizer,
    read_config,
    resolve_model_dir,
    save_checkpoint,
)
from splitphase.model.tokenizer import Tokenizer
from splitphase.model.transformer import TORCH_DTYPES, Transformer

__all__ = [
    "DisaggConfig",
    "DisaggregatedEngine",
    "WorkerDiedError",
    "WorkerStartError",
    "WorkerStepRecord",
]


class DisaggregatedEngine:
    """The front end of a prefill/decode worker pair, with LLMEngine's request interface."""

    def __init__(
        self,
        config: DisaggConfig,
        tokenizer: Tokenizer | None = None,
        owned_dir: tempfile.TemporaryDirectory[str] | None = None,
    ) -> None:
        self.config = config
        self.vocab_size = read_config(resolve_model_dir(config.model))[0].vocab_size
        self.tokenizer = tokenizer or load_tokenizer(config.model, config.tokenizer_dir)
        self.steps: list[StepRecord] = []
        self._state = FrontendState()
        self._workers: dict[str, WorkerHandle] = {}
        self._dead: dict[str, str] = {}
        self._broken: str | None = None
        self._ids = itertools.count()
        self._closed = False
        # Set as the workers start: the longest request both can hold; the decode worker's
        # K/V pool (blocks, tokens a block), the one decode batches are bounded by.
        self.max_model_len = self.kv_pool_blocks = self.kv_block_size = 0
        self._authkey = resolve_authkey(config.spawn_workers)
        self._procs: list[Any] = []  # local processes, for the finalizer too
        self._server = ControlServer(config.host, config.control_port, self._authkey)
        # Kills local workers and removes the temp checkpoint even if close() is never called.
        self._finalizer = weakref.finalize(self, cleanup, self._procs, self._server, owned_dir)
        try:
            self._start_workers()
        except BaseException:
            self.close()
            raise

    @classmethod
    def launch(
        cls,
        model: str | Transformer,
        tokenizer: Tokenizer | None = None,
        device: str = "cpu",
        dtype: str | None = None,
        **engine_kwargs: Any,
    ) -> DisaggregatedEngine:
        """A local pair for a model name/path, or an in-memory model (via a temp checkpoint)."""
        policy, role = engine_kwargs.pop("policy", "disaggregated"), engine_kwargs.pop("role", None)
        if policy != "disaggregated" or role is not None:
            raise UserError("a disaggregated engine runs both roles: drop policy/role options")
        in_memory = isinstance(model, Transformer)
        owned = None
        if in_memory or tokenizer is not None:  # workers read both from disk
            owned = tempfile.TemporaryDirectory(prefix="splitphase-disagg-")
            save_tokenizer(tokenizer or Tokenizer.default(), owned.name)
        if isinstance(model, str):
            path = model
        else:
            assert owned is not None
            path = owned.name
            # Stored in the dtype it computes in now (it may have been cast after building).
            dtype = dtype or {v: k for k, v in TORCH_DTYPES.items()}[model.dtype]
            save_checkpoint(model, path, dtype=dtype)
            device = str(model.device)
        config = DisaggConfig(
            model=path,
            tokenizer_dir=owned.name if owned else None,
            prefill_device=device,
            decode_device=device,
            dtype=dtype,
            engine=engine_kwargs,
        )
        return cls(config, tokenizer or (Tokenizer.default() if owned else None), owned)

    # ---- the pair -------------------------------------------------------------------------
    def _start_workers(self) -> None:
        cfg, procs = self.config, {}
        session = secrets.token_hex(8) if cfg.spawn_workers else ""
        if cfg.spawn_workers:
            dist_init = f"tcp://{cfg.host}:{free_port(cfg.host)}"
            control = f"{self._server.address[0]}:{self._server.address[1]}"
            for role in ROLES:
                device = cfg.prefill_device if role == "prefill" else cfg.decode_device
                engine = cfg.engine | (cfg.decode_engine if role == "decode" else {})
                opts = WorkerOptions(
                    role,
                    cfg.model,
                    control,
                    dist_init,
                    device,
                    cfg.dtype,
                    cfg.tokenizer_dir,
                    cfg.local_backend(),
                    cfg.timeout_s,
                    cfg.worker_threads,
                    session,
                    engine,
                )
                procs[role] = spawn_worker(opts, self._authkey)
                self._procs.append(procs[role])
        ready = await_workers(self._server, session, procs, cfg.startup_timeout_s)
        self._workers = {role: ready[role] for role in ROLES}  # prefill first, always
        self.max_model_len = min(w.info["max_model_len"] for w in self._workers.values())
        decode = self._workers["decode"].info
        self.kv_pool_blocks, self.kv_block_size = decode["num_blocks"], decode["block_size"]

    def restart(self) -> None:
        """Replace the pair: a fresh process group on a new port; in-flight requests fail."""
        self._check_open()
        self._shutdown_workers()
        self._state.fail(list(self._state.live), "the engine was restarted")
        self._dead.clear()
        self._broken = None
        self._start_workers()

    def close(self) -> None:
        """Shut both workers down (killing them if they do not exit) and release resources."""
        if self._closed:
            return
        self._closed = True
        self._shutdown_workers()
        self._finalizer()

    def __enter__(self) -> DisaggregatedEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _shutdown_workers(self) -> None:
        for w in self._workers.values():  # prefill first: its goodbye lets decode stop cleanly
            _try_send(w, ("shutdown",))
        stop_processes([w.proc for w in self._workers.values() if w.proc is not None], 5.0)
        for w in self._workers.values():
            w.conn.close()
            if w.proc in self._procs:
                self._procs.remove(w.proc)
        self._workers = {}

    @property
    def worker_pids(self) -> dict[str, int]:
        """Process id of each worker (as the worker reported it)."""
        return {role: w.pid for role, w in self._workers.items()}

    @property
    def dead_workers(self) -> dict[str, str]:
        """Role -> why, for each worker lost since the last (re)start (for health checks)."""
        return dict(self._dead)

    def check_workers(self) -> dict[str, str]:
        """Read worker news and check both processes now (idle too); returns `dead_workers`."""
        self._check_open()
        self._pump(0.0)
        self._check_liveness()
        return self.dead_workers

    # ---- requests ---------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_s: float | None = None,
        prompt_logprobs: int | None = None,
    ) -> str:
        """Queue a request (text or token ids) on the prefill worker; returns its id."""
        self._check_open()
        self._pump(0.0)  # a worker that died while we were idle is noticed here, not later
        self._check_liveness()
        if self._broken is not None:
            raise WorkerDiedError(f"{self._broken}; call restart() for a fresh worker pair")
        params = params or SamplingParams()
        ids = (
            self.tokenizer.encode(prompt, add_bos=True) if isinstance(prompt, str) else list(prompt)
        )
        self._check_prompt(ids, params)
        rid = request_id or f"req-{next(self._ids)}"
        arrival = time.perf_counter() if arrival_s is None else arrival_s
        self._state.add(rid, ids, params, arrival)
        self._send(
            "prefill",
            ("add", AddRequest(rid, ids, params, arrival, prompt_logprobs, ClockStamp.now())),
        )
        return rid

    def _check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        validate_prompt(ids, params, self.vocab_size, self.max_model_len)

    def abort_request(
        self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> None:
        """Abort a request (and its n > 1 siblings) on both workers; blocks are freed there."""
        ids = self._state.abort(request_id, status)
        if ids:
            for role in ROLES:
                self._send(role, ("abort", ids))

    def has_unfinished_requests(self) -> bool:
        """True while any request still owes an output (or an error)."""
        return self._state.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Wait up to poll_s for worker news; return the outputs of requests that advanced."""
        self._check_open()
        self._pump(0.0 if self._state.has_news() else self.config.poll_s)
        self._check_liveness()
        outputs = self._state.collect()
        failed = self._state.take_failed() if not outputs else None
        if failed:
            raise StepFailedError(failed[0], WorkerDiedError(failed[1]))
        return outputs

    def block_usage(self, timeout_s: float = 10.0) -> dict[str, dict[str, int]]:
        """Each worker's KV block usage, asked over the control plane (after earlier commands)."""
        self._check_open()
        for role in ROLES:
            if role in self._dead:
                raise WorkerDiedError(f"the {role} worker {self._dead[role]}")
            self._workers[role].usage = None
            self._send(role, ("usage",))
        deadline = time.monotonic() + timeout_s
        while any(w.usage is None for w in self._workers.values()):
            if self._dead:
                raise WorkerDiedError(next(iter(self._dead.values())))
            if time.monotonic() > deadline:
                raise TimeoutError(f"no usage reply from the workers within {timeout_s} s")
            self._pump(0.05)
            self._check_liveness()
        return {role: dict(w.usage or {}) for role, w in self._workers.items()}

    # ---- worker news --------------------------------------------------------------------------
    def _pump(self, timeout_s: float) -> None:
        conns = {w.conn: w for role, w in self._workers.items() if role not in self._dead}
        for ready in wait(list(conns), timeout_s) if conns else []:
            conn = cast(Connection, ready)
            w = conns[conn]
            try:
                while w.role not in self._dead and conn.poll():
                    self._on_message(w, conn.recv())
            except (EOFError, OSError) as exc:
                self._lost(w.role, f"closed its control connection ({type(exc).__name__})")

    def _on_message(self, w: WorkerHandle, msg: tuple[Any, ...]) -> None:
        w.last_heard_s = time.monotonic()
        kind = msg[0]
        if kind == "update":
            self.steps += [WorkerStepRecord(**asdict(s), role=w.role) for s in msg[1].steps]
            aborts, readmits = self._state.apply(w.role, msg[1])
            if aborts:
                self._send(w.role, ("abort", aborts))
            for meta in readmits:
                self._readmit(meta)
        elif kind == "usage":
            w.usage = msg[1]
        elif kind == "fatal":
            self._lost(w.role, f"failed: {msg[1]}")
        elif kind == "peer_lost":
            self._lost("prefill", f"is unreachable from the decode worker: {msg[1]}")

    def _readmit(self, meta: dict[str, Any]) -> None:
        rid = meta["request"]["request_id"]
        if "prefill" in self._dead:
            self._state.fail([rid], f"preempted while the prefill worker {self._dead['prefill']}")
        else:
            self._send("prefill", ("readmit", meta))

    def _check_liveness(self) -> None:
        now = time.monotonic()
        for role, w in list(self._workers.items()):
            code = w.proc.poll() if w.proc is not None else None
            if role in self._dead:
                continue
            if code is not None:
                self._lost(role, describe_exit(code))
            elif now - w.last_heard_s > self.config.timeout_s:
                self._lost(role, f"sent nothing for {self.config.timeout_s:.0f} s")

    def _lost(self, role: str, reason: str) -> None:
        """Mark a worker dead, make sure it is, and fail the requests it could affect."""
        if role in self._dead:
            return
        self._dead[role] = reason
        self._broken = self._broken or f"the {role} worker {reason}"
        w = self._workers.get(role)
        if w is not None and w.proc is not None and w.proc.poll() is None:
            w.proc.kill()  # silent or confused: do not let it act on requests we failed
            w.proc.wait()
        # Every request ends up on the decode worker, so losing it fails all of them.
        affected = [
            rid
            for rid, live in self._state.live.items()
            if role == "decode" or live.owner == "prefill"
        ]
        self._state.fail(affected, f"the {role} worker {reason}")

    def _send(self, role: str, msg: tuple[Any, ...]) -> None:
        w = self._workers.get(role)
        if w is None or role in self._dead:
            return
        if not _try_send(w, msg):
            self._lost(role, "closed its control connection")

    def _check_open(self) -> None:
        if self._closed:
            raise WorkerDiedError("the disaggregated engine is closed")


def _try_send(w: WorkerHandle, msg: tuple[Any, ...]) -> bool:
    try:
        w.conn.send(msg)
        return True
    except OSError:
        return False
