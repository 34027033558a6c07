"""KV transfer from the prefill worker (rank 0) to the decode worker (rank 1) by dist p2p.

One ordered channel, one sender thread and one receiver thread. Each message is an int64 header
`(kind, blob_len)`; a handoff follows it with the pickled metadata blob (request fields,
sampling params, outputs so far, generator state, text offsets, K/V geometry) as a uint8
tensor, then K and V (L, T, G, D) as raw bytes (so any dtype travels over gloo and nccl alike).

Idle time: a blocking recv times out after the process group's timeout, so the sender sends a
heartbeat header every `timeout / 4` seconds while it has nothing to send. A recv that times
out therefore means the peer is gone, not that it is quiet. A dead peer shows up sooner, as a
closed connection, on the next send or recv.
"""

from __future__ import annotations

import pickle
import queue
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from splitphase.engine.disagg_protocol import ClockStamp, request_from_meta, request_meta
from splitphase.engine.llm_engine import Handoff
from splitphase.errors import UserError

KIND_HANDOFF, KIND_BEAT, KIND_CLOSE = 0, 1, 2
PREFILL_RANK, DECODE_RANK = 0, 1
BACKENDS = ("auto", "gloo", "nccl")


def resolve_backend(requested: str, device: torch.device) -> str:
    """'auto' is nccl for a CUDA worker and gloo otherwise; both workers must agree."""
    if requested not in BACKENDS:
        raise UserError(f"backend must be one of {BACKENDS}, got {requested!r}")
    if requested == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if requested == "nccl" and device.type != "cuda":
        raise UserError("backend 'nccl' needs a CUDA device; use 'gloo' for CPU workers")
    return requested


def init_transfer_group(init_method: str, rank: int, backend: str, timeout_s: float) -> None:
    """Join the two-rank process group; rank 0 (prefill) hosts the TCP store at init_method."""
    if not init_method.startswith("tcp://"):
        raise UserError(f"--dist-init must be tcp://HOST:PORT, got {init_method!r}")
    dist.init_process_group(
        backend,
        init_method=init_method,
        world_size=2,
        rank=rank,
        timeout=timedelta(seconds=timeout_s),
    )


def close_transfer_group() -> None:
    """Leave the process group (no-op when it was never joined)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def handoff_meta(h: Handoff) -> dict[str, Any]:
    """Everything of a handoff but its K/V, as plain data."""
    return {
        "request": request_meta(h.request),
        "generator_state": h.generator_state.numpy().tobytes(),
        "sent_chars": h.sent_chars,
        "sent_tokens": h.sent_tokens,
        "clock": ClockStamp.now(),
        "kv": (tuple(h.k.shape), str(h.k.dtype).removeprefix("torch.")),
    }


def handoff_from_meta(meta: dict[str, Any], k: torch.Tensor, v: torch.Tensor) -> Handoff:
    """Rebuild a handoff on this process's clock around received (or empty) K/V."""
    req = request_from_meta(meta["request"], meta["clock"].shift_s())
    state = torch.frombuffer(bytearray(meta["generator_state"]), dtype=torch.uint8)
    return Handoff(req, k, v, state, meta["sent_chars"], meta["sent_tokens"])


def empty_kv(meta: dict[str, Any]) -> torch.Tensor:
    """A (L, 0, G, D) tensor: the K or V of a handoff that carries none (a preempted request)."""
    shape, dtype = meta["kv"]
    return torch.empty((shape[0], 0, *shape[2:]), dtype=getattr(torch, dtype))


class KVSender:
    """Prefill side: sends queued handoffs to rank 1 on a thread, heartbeats when idle."""

    def __init__(self, device: torch.device, timeout_s: float) -> None:
        self._device = device  # where tensors must be for the backend (CUDA for nccl)
        self._beat_s = timeout_s / 4
        self._queue: queue.Queue[Handoff | None] = queue.Queue()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kv-sender", daemon=True)
        self._thread.start()

    def put(self, handoff: Handoff) -> None:
        """Queue a handoff; it is sent after every handoff queued before it."""
        self._queue.put(handoff)

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued, then a close header, and stop the thread."""
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            while True:
                try:
                    item = self._queue.get(timeout=self._beat_s)
                except queue.Empty:
                    self._header(KIND_BEAT, 0)
                    continue
                if item is None:
                    self._header(KIND_CLOSE, 0)
                    return
                self._send_handoff(item)
        except BaseException as exc:  # reported by the worker loop, which owns the exit
            self.error = exc

    def _header(self, kind: int, n: int) -> None:
        dist.send(torch.tensor([kind, n], dtype=torch.int64, device=self._device), DECODE_RANK)

    def _send_handoff(self, h: Handoff) -> None:
        blob = pickle.dumps(handoff_meta(h))
        self._header(KIND_HANDOFF, len(blob))
        payload = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(self._device)
        dist.send(payload, DECODE_RANK)
        for t in (h.k, h.v):
            dist.send(_as_bytes(t.to(self._device)), DECODE_RANK)


class KVReceiver:
    """Decode side: receives handoffs on a thread and queues them for the worker loop."""

    def __init__(self, device: torch.device, on_arrival: Callable[[], None]) -> None:
        self._device = device
        self._on_arrival = on_arrival  # wakes the worker loop; called from this thread
        self._queue: queue.Queue[Handoff] = queue.Queue()
        self.error: BaseException | None = None
        self.closed = False  # the prefill worker said goodbye
        self._thread = threading.Thread(target=self._run, name="kv-receiver", daemon=True)
        self._thread.start()

    def drain(self) -> list[Handoff]:
        """Every complete handoff received so far, in order."""
        out = []
        while True:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                return out

    def join(self, timeout_s: float) -> bool:
        """Wait for the thread; True if it has ended."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            while True:
                header = torch.empty(2, dtype=torch.int64, device=self._device)
                dist.recv(header, PREFILL_RANK)
                kind, n = (int(x) for x in header.tolist())
                if kind == KIND_CLOSE:
                    self.closed = True
                    return
                if kind == KIND_HANDOFF:
                    self._queue.put(self._recv_handoff(n))
                    self._on_arrival()
        except BaseException as exc:
            self.error = exc
            self._on_arrival()

    def _recv_handoff(self, n: int) -> Handoff:
        blob = torch.empty(n, dtype=torch.uint8, device=self._device)
        dist.recv(blob, PREFILL_RANK)
        meta = pickle.loads(blob.cpu().numpy().tobytes())
        shape, dtype_name = meta["kv"]
        dtype = getattr(torch, dtype_name)
        kv = []
        for _ in range(2):
            buf = torch.empty(
                _numel(shape) * dtype.itemsize, dtype=torch.uint8, device=self._device
            )
            dist.recv(buf, PREFILL_RANK)
            kv.append(buf.view(dtype).view(shape))
        if self._device.type == "cuda":
            # nccl recv only orders the stream; the worker loop reads these on its own thread.
            torch.cuda.current_stream(self._device).synchronize()
        return handoff_from_meta(meta, kv[0], kv[1])


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
