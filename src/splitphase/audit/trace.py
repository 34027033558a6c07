"""What the audit sends (`ProbeRequest`) and what it records per request (`RequestTrace`).

All timestamps are `time.perf_counter()` seconds on the machine running the audit; only
differences between them mean anything. Server-side phase times, when a target can scrape them,
are per-request means over the probe point they were measured in (Prometheus histograms are
aggregates), so every trace of one point carries the same server-side values.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from itertools import pairwise
from typing import Any


@dataclass(frozen=True)
class ProbeRequest:
    """One request of the probe workload: prompt (as ids and as text) and output length."""

    prompt_ids: tuple[int, ...]
    prompt_text: str
    output_tokens: int
    point: str  # probe point this request belongs to, e.g. "len=128 c=4"
    concurrency: int = 1
    role: str = "sweep"  # sweep | stream | inject (the prefill-interference probe)
    start_offset_s: float = 0.0  # send time after the run starts (streaming targets honour it)

    @property
    def prompt_tokens(self) -> int:
        """Prompt length in the target's tokens."""
        return len(self.prompt_ids)


@dataclass
class RequestTrace:
    """Timeline of one request: send, first token, every token, end, and server-side phases."""

    prompt_tokens: int
    output_tokens: int
    send_s: float
    first_token_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)  # arrival of each token or chunk
    end_s: float | None = None
    error: str | None = None
    point: str = ""
    concurrency: int = 1
    role: str = "sweep"
    server_queue_s: float | None = None
    server_prefill_s: float | None = None
    server_itl_s: float | None = None  # mean decode step time per token, server side
    preemptions: int = 0  # times its K/V was taken back (where the runner sees it)

    @property
    def ok(self) -> bool:
        """Finished without error and produced a first token."""
        return self.error is None and self.first_token_s is not None

    @property
    def ttft_s(self) -> float | None:
        """Time to first token as the client saw it."""
        return None if self.first_token_s is None else self.first_token_s - self.send_s

    def prefill_s(self) -> float | None:
        """Prefill time: server-side if scraped, else TTFT minus server queue, else TTFT."""
        if self.server_prefill_s is not None:
            return self.server_prefill_s
        ttft = self.ttft_s
        if ttft is None:
            return None
        return ttft - self.server_queue_s if self.server_queue_s is not None else ttft

    def itl_s(self) -> list[float]:
        """Per-token inter-token gaps; chunks that carried several tokens are spread evenly."""
        times = self.token_times_s
        if len(times) < 2:
            return []
        gaps = [b - a for a, b in pairwise(times)]
        if self.output_tokens > len(times):
            # n chunks carried `output_tokens` tokens: each gap covers that many tokens on average.
            scale = (len(times) - 1) / (self.output_tokens - 1)
            return [g * scale for g in gaps]
        return gaps

    def tokens_by(self, t_s: float) -> int:
        """Output tokens that had arrived by time `t_s` (chunks spread evenly)."""
        arrived = sum(1 for x in self.token_times_s if x <= t_s)
        if not self.token_times_s or self.output_tokens <= len(self.token_times_s):
            return arrived
        return round(arrived * self.output_tokens / len(self.token_times_s))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestTrace:
        return cls(**data)


def trace_for(request: ProbeRequest, send_s: float) -> RequestTrace:
    """An empty trace for `request`, sent at `send_s`."""
    return RequestTrace(
        prompt_tokens=request.prompt_tokens,
        output_tokens=0,
        send_s=send_s,
        point=request.point,
        concurrency=request.concurrency,
        role=request.role,
    )
