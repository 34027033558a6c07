"""Simulated traffic: arrival processes, prompt/output length distributions, traces, presets.

`--workload` takes one of:
- a preset name: chat, rag, code, summarization (see `PRESETS`);
- `poisson:RATE[,prompt=DIST][,output=DIST][,lengths=trace:PATH]`;
- `gamma:RATE:CV[,...]`: bursty arrivals, gamma inter-arrival times with coefficient of
  variation CV (CV = 1 is Poisson, CV > 1 is burstier);
- `trace:PATH[,start=N]`: a JSONL trace replayed as recorded (Mooncake format: `timestamp` in
  ms, `input_length`, `output_length`, `hash_ids` of 512-token prefix blocks; or the audit's
  `prompt_tokens` / `output_tokens`) from its N-th request (0, the first, by default);
  requests that share a timestamp arrive spread inside the trace's time resolution
  (`spread_ties`).
DIST is `fixed:N`, `uniform:LO:HI`, `lognormal:MEDIAN:SIGMA` or `trace:PATH` (the trace's
lengths, sampled). A preset also takes options: `rag,rate=2`. `lengths=trace:PATH` samples
(prompt, output) pairs jointly from a trace.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path

from splitphase.errors import UserError

TRACE_BLOCK_TOKENS = 512  # Mooncake hash_ids cover 512-token prefix blocks


class WorkloadError(UserError):
    """A workload spec or trace that cannot be used; the message says what is allowed."""


@dataclass(frozen=True)
class SimRequest:
    """One simulated request: when it arrives, its lengths and its prefix blocks (may be empty)."""

    index: int
    arrival_s: float
    prompt_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class TraceRecord:
    """One line of a trace."""

    timestamp_s: float
    prompt_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution: fixed, uniform, lognormal or empirical (trace values)."""

    kind: str
    a: float = 0.0
    b: float = 0.0
    values: tuple[int, ...] = ()

    def sample(self, rng: random.Random) -> int:
        """One length >= 1."""
        if self.kind == "fixed":
            n = self.a
        elif self.kind == "uniform":
            n = rng.randint(int(self.a), int(self.b))
        elif self.kind == "lognormal":
            n = self.a * math.exp(rng.gauss(0.0, self.b))
        else:
            n = rng.choice(self.values)
        return max(1, int(round(n)))

    @property
    def mean(self) -> float:
        """Expected length (before clipping to the context)."""
        if self.kind == "fixed":
            return self.a
        if self.kind == "uniform":
            return (self.a + self.b) / 2
        if self.kind == "lognormal":
            return self.a * math.exp(self.b**2 / 2)
        return sum(self.values) / len(self.values)

    def describe(self) -> str:
        """The spec string this distribution parses from (empirical: its size)."""
        if self.kind == "fixed":
            return f"fixed:{int(self.a)}"
        if self.kind == "uniform":
            return f"uniform:{int(self.a)}:{int(self.b)}"
        if self.kind == "lognormal":
            return f"lognormal:{self.a:g}:{self.b:g}"
        return f"empirical({len(self.values)} values)"


@dataclass(frozen=True)
class WorkloadSpec:
    """Arrivals (poisson, gamma or trace replay) and lengths; `generate` draws the requests."""

    name: str
    arrival: str = "poisson"  # poisson | gamma | trace
    rate_per_s: float = 1.0
    cv: float = 1.0
    prompt: LengthDist = LengthDist("fixed", 512)
    output: LengthDist = LengthDist("fixed", 128)
    pairs: tuple[tuple[int, int], ...] = ()  # joint (prompt, output) lengths from a trace
    trace: tuple[TraceRecord, ...] = ()
    # As the trace recorded its arrivals: distinct timestamps and the smallest gap between
    # them (`spread_ties` spreads the requests that share one inside that gap).
    trace_timestamps: int = 0
    trace_resolution_s: float = 0.0
    trace_start: int = 0  # index in the recording of `trace[0]` (those before it are skipped)

    def with_rate(self, rate_per_s: float) -> WorkloadSpec:
        """The same workload at another mean arrival rate (a trace is time-scaled)."""
        check_rate(rate_per_s)
        return replace(self, rate_per_s=rate_per_s)

    @property
    def mean_prompt_len(self) -> float:
        if self.trace:
            return sum(r.prompt_len for r in self.trace) / len(self.trace)
        if self.pairs:
            return sum(p for p, _ in self.pairs) / len(self.pairs)
        return self.prompt.mean

    @property
    def mean_output_len(self) -> float:
        if self.trace:
            return sum(r.output_len for r in self.trace) / len(self.trace)
        if self.pairs:
            return sum(o for _, o in self.pairs) / len(self.pairs)
        return self.output.mean

    def generate(self, num_requests: int, seed: int = 0, max_len: int | None = None
                 ) -> list[SimRequest]:
        """`num_requests` requests, arrival order; lengths clipped to fit `max_len` tokens."""
        if num_requests < 1:
            raise WorkloadError(f"the number of requests must be >= 1, got {num_requests}")
        if self.arrival == "trace":
            return self._replay(num_requests, max_len)
        rng = random.Random(seed)
        # Arrivals and lengths draw from separate streams, so changing the rate moves every
        # arrival proportionally and keeps the lengths (common random numbers across rates).
        len_rng = random.Random(seed + 1)
        t, out = 0.0, []
        for i in range(num_requests):
            t += self._gap_s(rng)
            if self.pairs:
                p, o = len_rng.choice(self.pairs)
            else:
                p, o = self.prompt.sample(len_rng), self.output.sample(len_rng)
            p, o = _clip(p, o, max_len)
            out.append(SimRequest(i, t, p, o))
        return out

    def _gap_s(self, rng: random.Random) -> float:
        if self.arrival == "gamma":
            shape = 1.0 / self.cv**2  # mean shape*scale = 1/rate, CV = 1/sqrt(shape)
            return rng.gammavariate(shape, 1.0 / (shape * self.rate_per_s))
        return rng.expovariate(self.rate_per_s)

    def _replay(self, num_requests: int, max_len: int | None) -> list[SimRequest]:
        recs = self.trace[:num_requests]
        t0 = recs[0].timestamp_s
        span = recs[-1].timestamp_s - t0
        # Scale time so the mean rate over the replayed span is rate_per_s.
        scale = (len(recs) - 1) / span / self.rate_per_s if span > 0 else 1.0
        out = []
        for i, r in enumerate(recs):
            p, o = _clip(r.prompt_len, r.output_len, max_len)
            out.append(SimRequest(i, (r.timestamp_s - t0) * scale, p, o, r.hash_ids))
        return out

    def describe(self) -> dict[str, object]:
        """JSON-ready description."""
        doc: dict[str, object] = {"name": self.name, "arrival": self.arrival,
                                  "rate_per_s": self.rate_per_s}
        if self.arrival == "gamma":
            doc["cv"] = self.cv
        if self.trace:
            doc["trace_requests"] = self.trace_start + len(self.trace)
            doc["trace_start"] = self.trace_start
            doc["trace_timestamps"] = self.trace_timestamps
            doc["trace_resolution_s"] = round(self.trace_resolution_s, 6)  # ms stamps
        elif self.pairs:
            doc["lengths"] = f"trace pairs ({len(self.pairs)})"
        else:
            doc["prompt"], doc["output"] = self.prompt.describe(), self.output.describe()
        doc["mean_prompt_tokens"] = round(self.mean_prompt_len, 1)
        doc["mean_output_tokens"] = round(self.mean_output_len, 1)
        return doc


def _clip(prompt_len: int, output_len: int, max_len: int | None) -> tuple[int, int]:
    if max_len is None:
        return prompt_len, output_len
    prompt_len = min(prompt_len, max_len - 1)
    return prompt_len, max(1, min(output_len, max_len - prompt_len))


def check_rate(rate_per_s: float) -> None:
    """A usable arrival rate: finite and > 0."""
    if not (isinstance(rate_per_s, (int, float)) and math.isfinite(rate_per_s) and rate_per_s > 0):
        raise WorkloadError(f"the request rate must be a number > 0 per second, got {rate_per_s}")


# Typical shapes, not measurements of any one service: chat after ShareGPT-style conversations,
# RAG with retrieved context in the prompt, code completion (long context, short output),
# summarization (long document, paragraph out).
PRESETS: dict[str, WorkloadSpec] = {
    "chat": WorkloadSpec("chat", prompt=LengthDist("lognormal", 600, 0.8),
                         output=LengthDist("lognormal", 220, 0.6)),
    "rag": WorkloadSpec("rag", prompt=LengthDist("lognormal", 4000, 0.3),
                        output=LengthDist("lognormal", 150, 0.5)),
    "code": WorkloadSpec("code", prompt=LengthDist("lognormal", 1500, 0.5),
                         output=LengthDist("lognormal", 40, 0.6)),
    "summarization": WorkloadSpec("summarization", prompt=LengthDist("lognormal", 3000, 0.4),
                                  output=LengthDist("lognormal", 250, 0.3)),
}


def load_trace(path: str | Path) -> tuple[TraceRecord, ...]:
    """Read a JSONL trace (Mooncake or the audit's format), sorted by arrival."""
    p = Path(path).expanduser()
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise WorkloadError(f"cannot read trace {p}: {exc.strerror or exc}") from exc
    recs = [_record(line, f"{p}:{i + 1}") for i, line in enumerate(lines) if line.strip()]
    if not recs:
        raise WorkloadError(f"trace {p} holds no requests; give a JSONL file with one per line")
    return tuple(sorted(recs, key=lambda r: r.timestamp_s))


def time_resolution(trace: tuple[TraceRecord, ...]) -> tuple[int, float]:
    """(distinct timestamps, smallest gap between two of them; 0 with fewer than two)."""
    stamps = sorted({r.timestamp_s for r in trace})
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return len(stamps), min(gaps, default=0.0)


def spread_ties(trace: tuple[TraceRecord, ...], seed: int = 0) -> tuple[TraceRecord, ...]:
    """Arrival times inside the trace's time resolution, where requests share a timestamp.

    Mooncake's conversation trace stamps its requests in ticks of 3 s (about ten a tick):
    replayed as stamped, each tick is a burst of prompts arriving at the same instant, which
    no rescaling of the rate dissolves. The resolution is taken as the smallest gap between
    distinct timestamps; the requests of a tick get uniform random times inside it (how a
    Poisson process's arrivals fall, given their count), in the trace's order. A trace of
    one timestamp is left as it is: nothing states its spread.
    """
    stamps, resolution_s = time_resolution(trace)
    if stamps < 2:
        return trace
    rng, out, i = random.Random(seed), [], 0
    while i < len(trace):
        j = i
        while j < len(trace) and trace[j].timestamp_s == trace[i].timestamp_s:
            j += 1
        offsets = [0.0] if j - i == 1 else sorted(rng.uniform(0, resolution_s)
                                                   for _ in range(j - i))
        out += [replace(r, timestamp_s=r.timestamp_s + o) for r, o in zip(trace[i:j], offsets,
                                                                           strict=True)]
        i = j
    return tuple(out)


def _record(line: str, where: str) -> TraceRecord:
    try:
        doc = json.loads(line)
        prompt = int(doc.get("input_length", doc.get("prompt_tokens")))
        output = int(doc.get("output_length", doc.get("output_tokens")))
        ts_ms = float(doc.get("timestamp", 0.0))
        hashes = tuple(int(h) for h in doc.get("hash_ids", ()))
    except (ValueError, TypeError, AttributeError) as exc:
        raise WorkloadError(
            f"{where}: need input_length/output_length (or prompt_tokens/output_tokens) and"
            f" an optional timestamp in ms ({exc})"
        ) from exc
    if prompt < 1 or output < 1 or ts_ms < 0:
        raise WorkloadError(f"{where}: lengths must be >= 1 and the timestamp >= 0")
    return TraceRecord(ts_ms / 1e3, prompt, output, hashes)


def parse_dist(text: str) -> LengthDist:
    """`fixed:N`, `uniform:LO:HI`, `lognormal:MEDIAN:SIGMA` or `trace:PATH` (input lengths)."""
    kind, _, rest = text.partition(":")
    try:
        if kind == "trace":
            return LengthDist("empirical", values=tuple(r.prompt_len for r in load_trace(rest)))
        nums = [float(x) for x in rest.split(":")] if rest else []
    except ValueError:
        nums = []
    shapes = {"fixed": 1, "uniform": 2, "lognormal": 2}
    if kind not in shapes or len(nums) != shapes[kind] or any(x <= 0 for x in nums) or (
        kind == "uniform" and nums[0] > nums[1]
    ):
        raise WorkloadError(
            f"bad length distribution {text!r}; use fixed:N, uniform:LO:HI, "
            "lognormal:MEDIAN:SIGMA (all > 0) or trace:PATH"
        )
    return LengthDist(kind, nums[0], nums[1] if len(nums) > 1 else 0.0)


def parse_workload(spec: str) -> WorkloadSpec:
    """A `--workload` spec (see the module docstring) as a WorkloadSpec."""
    head, *opts = [s.strip() for s in spec.split(",")]
    kind, _, rest = head.partition(":")
    if kind == "trace":
        return _trace_workload(rest, opts)
    if kind in PRESETS and not rest:
        wl = PRESETS[kind]
    elif kind in ("poisson", "gamma"):
        wl = _arrivals(kind, rest)
    else:
        raise WorkloadError(
            f"unknown workload {spec!r}; use a preset ({', '.join(PRESETS)}), poisson:RATE,"
            " gamma:RATE:CV (options: ,prompt=DIST ,output=DIST ,lengths=trace:PATH) or"
            " trace:PATH[,start=N]"
        )
    return _with_options(wl, opts)


def _trace_workload(path: str, opts: list[str]) -> WorkloadSpec:
    """A trace replay from its `start=N`-th request: a trace is not stationary, so which
    stretch is replayed can move a plan, and `start` picks another one."""
    start = 0
    for opt in opts:
        key, _, value = opt.partition("=")
        if key != "start" or not (value.isascii() and value.isdigit()):
            raise WorkloadError(f"bad trace option {opt!r}; trace:PATH takes only start=N (the"
                                " first request replayed, from 0): the trace gives lengths and"
                                " times")
        start = int(value)
    recorded = load_trace(path)
    if start >= len(recorded):
        raise WorkloadError(f"start={start} skips every request: {Path(path).name} holds"
                            f" {len(recorded)} (start counts from 0)")
    stamps, resolution_s = time_resolution(recorded)
    # Ties spread over the whole recording, then cut: a request arrives at the same offset
    # inside its tick whichever stretch is replayed.
    trace = spread_ties(recorded)[start:]
    span = trace[-1].timestamp_s - trace[0].timestamp_s
    rate = (len(trace) - 1) / span if span > 0 else 1.0
    name = f"trace:{Path(path).name}" + (f",start={start}" if start else "")
    return WorkloadSpec(name, "trace", rate, trace=trace, trace_timestamps=stamps,
                        trace_resolution_s=resolution_s, trace_start=start)


def _arrivals(kind: str, rest: str) -> WorkloadSpec:
    parts = rest.split(":") if rest else []
    want = 1 if kind == "poisson" else 2
    try:
        nums = [float(x) for x in parts]
    except ValueError:
        nums = []
    if len(nums) != want:
        raise WorkloadError(f"{kind} takes {'RATE' if want == 1 else 'RATE:CV'}, got {rest!r}")
    check_rate(nums[0])
    if kind == "gamma" and not nums[1] > 0:
        raise WorkloadError(f"gamma CV must be > 0, got {nums[1]}")
    cv = nums[1] if kind == "gamma" else 1.0
    return WorkloadSpec(f"{kind}:{rest}", kind, nums[0], cv)


def _with_options(wl: WorkloadSpec, opts: list[str]) -> WorkloadSpec:
    for opt in opts:
        key, sep, value = opt.partition("=")
        if not sep:
            raise WorkloadError(f"workload option {opt!r} must look like key=value")
        if key == "prompt":
            wl = replace(wl, prompt=parse_dist(value))
        elif key == "output":
            dist = parse_dist(value)
            if value.startswith("trace:"):
                dist = LengthDist("empirical",
                                  values=tuple(r.output_len for r in load_trace(value[6:])))
            wl = replace(wl, output=dist)
        elif key == "lengths" and value.startswith("trace:"):
            wl = replace(wl, pairs=tuple((r.prompt_len, r.output_len)
                                         for r in load_trace(value[6:])))
        elif key == "rate":
            try:
                wl = wl.with_rate(float(value))
            except ValueError:
                raise WorkloadError(f"rate must be a number, got {value!r}") from None
        else:
            raise WorkloadError(f"unknown workload option {key!r}; use prompt, output, "
                                "lengths=trace:PATH or rate")
    return replace(wl, name=",".join([wl.name, *opts]))
