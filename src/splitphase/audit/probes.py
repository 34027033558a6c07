"""The probe workload: a prompt-length sweep, a concurrency sweep, and a prefill-interference probe.

Prompts are real English (a built-in passage, tokenized by the target's own tokenizer, repeated
and cut to length), each opened by a unique tag so a server's prefix cache cannot skip the
prefill being measured. `--workload FILE` replaces the length sweep with lengths from a JSONL
file (`prompt_tokens`/`output_tokens`, or Mooncake's `input_length`/`output_length`).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from splitphase.audit.targets.base import Codec, Target
from splitphase.audit.trace import ProbeRequest, RequestTrace
from splitphase.errors import UserError

PASSAGE = (
    "The lighthouse keeper wrote the same line in his log every evening: the lamp was lit, the "
    "glass was clean, and the sea was whatever the sea had decided to be. Some nights it was a "
    "sheet of grey silk, and the beam slid across it without a ripple. Other nights the wind came "
    "round from the north and the waves climbed the rocks as if they meant to put the light out "
    "by hand. He did not think of the work as lonely. There were the ships, small lights moving "
    "along the edge of the world, and each of them trusted the flash that came every ten seconds "
    "from his tower. There were the gulls, who knew the hour of his supper better than he did. "
    "There was the radio, which brought the weather from the mainland in a calm voice that never "
    "changed, whatever it had to report. In the mornings he walked down to the village for bread "
    "and news. The baker asked about the storms, the schoolteacher asked about the birds, and the "
    "children asked whether he had ever seen a whale. He had, twice, and he told the story slowly "
    "so that it would last the length of the walk back up the hill. When the keepers were "
    "replaced by a machine that needed no supper and kept no log, he moved into a cottage below "
    "the tower. He still looked up at dusk, out of habit, to see the lamp come on. It always did, "
    "and he found that he was glad of it, and a little sorry, in equal measure. "
)
MAX_WORKLOAD_REQUESTS = {True: 16, False: 64}


@dataclass(frozen=True)
class ProbePlan:
    """What to send: prompt lengths at concurrency 1, concurrency levels at one prompt length."""

    prompt_lens: tuple[int, ...]
    concurrency_levels: tuple[int, ...]
    output_tokens: int
    decode_prompt_len: int
    repeats: int
    quick: bool = False
    interference: bool = True
    workload: tuple[tuple[int, int], ...] = field(default=())  # (prompt, output) pairs
    workload_file: str | None = None

    def __post_init__(self) -> None:
        if not self.prompt_lens or min(self.prompt_lens) < 1 or self.output_tokens < 2:
            raise UserError("a probe needs prompt lengths >= 1 and at least 2 output tokens")
        if not self.concurrency_levels or min(self.concurrency_levels) < 1 or self.repeats < 1:
            raise UserError("a probe needs concurrency levels >= 1 and repeats >= 1")


def _pow2_floor(x: int) -> int:
    return 1 << max(0, int(x).bit_length() - 1)


def plan_for(max_seq_len: int, quick: bool = False) -> ProbePlan:
    """The default probe, scaled to the model's context (32..512 on a 1k-context model)."""
    output_tokens = 16 if quick else 32
    room = max_seq_len - output_tokens
    if room < 8:
        raise UserError(f"the model's context ({max_seq_len}) is too short to probe")
    hi = _pow2_floor(min(room, max_seq_len // (4 if quick else 2), 1024 if quick else 4096))
    lo = min(32, hi)
    lens = [lo << i for i in range(int(math.log2(hi // lo)) + 1)]
    if quick and len(lens) > 3:
        lens = [lens[0], lens[len(lens) // 2], lens[-1]]
    return ProbePlan(
        prompt_lens=tuple(lens),
        concurrency_levels=(1, 4) if quick else (1, 2, 4, 8),
        output_tokens=output_tokens,
        decode_prompt_len=lens[len(lens) // 2],
        repeats=3,
        quick=quick,
    )


def load_workload(path: str | Path, max_seq_len: int, quick: bool) -> tuple[tuple[int, int], ...]:
    """(prompt, output) token pairs from a JSONL file, clipped to the context, evenly sampled."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise UserError(f"cannot read --workload {path}: {exc.strerror or exc}") from exc
    pairs = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            pairs.append(_workload_pair(line, f"{path}:{number}"))
    if not pairs:
        raise UserError(f"--workload {path} has no requests (one JSON object a line)")
    limit = MAX_WORKLOAD_REQUESTS[quick]
    step = max(1, len(pairs) // limit)
    sampled = pairs[::step][:limit]
    # Long traces (Mooncake averages 12k tokens) are cut to what the model's context holds.
    out = []
    for prompt, output in sampled:
        output = max(2, min(output, max_seq_len // 4))
        out.append((max(1, min(prompt, max_seq_len - output)), output))
    return tuple(out)


def _workload_pair(line: str, where: str) -> tuple[int, int]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise UserError(f"{where}: not valid JSON ({exc.msg})") from exc
    if not isinstance(row, dict):
        raise UserError(f"{where}: each line must be a JSON object")
    prompt = row.get("prompt_tokens", row.get("input_length"))
    output = row.get("output_tokens", row.get("output_length"))
    if not (isinstance(prompt, int) and isinstance(output, int) and prompt > 0 and output > 0):
        raise UserError(
            f"{where}: needs positive integers prompt_tokens and output_tokens "
            "(or input_length and output_length), got "
            f"{ {k: row.get(k) for k in list(row)[:4]} }"
        )
    return prompt, output


class PromptMaker:
    """Unique prompts of exact token lengths cut from the passage, in the target's tokenizer."""

    def __init__(self, codec: Codec) -> None:
        self._codec = codec
        self._stream = codec.encode(PASSAGE)
        if not self._stream:
            raise UserError("the target's tokenizer encoded the probe passage to no tokens")
        self._count = 0

    def make(self, n: int) -> tuple[tuple[int, ...], str]:
        """(ids, text) of a prompt with `n` tokens."""
        self._count += 1
        tag = self._codec.encode(f"[probe {self._count}] ")
        offset = (self._count * 37) % len(self._stream)  # a different cut of the passage each time
        body_len = max(0, n - len(tag))
        reps = (offset + body_len) // len(self._stream) + 1
        ids = (tag + (self._stream * reps)[offset : offset + body_len])[:n]
        return tuple(ids), self._codec.decode(ids)


def sweep_points(plan: ProbePlan, maker: PromptMaker) -> list[tuple[int, list[ProbeRequest]]]:
    """(concurrency, requests) per probe point, in the order they run."""
    points: list[tuple[int, list[ProbeRequest]]] = []

    def point(name: str, shapes: Sequence[tuple[int, int]], conc: int) -> None:
        reqs = []
        for prompt, output in shapes:
            ids, text = maker.make(prompt)
            reqs.append(ProbeRequest(ids, text, output, name, conc))
        points.append((conc, reqs))

    if plan.workload:
        for conc in sorted({1, max(plan.concurrency_levels)}):
            point(f"workload c={conc}", plan.workload, conc)
        return points
    for n in plan.prompt_lens:
        point(f"len={n} c=1", [(n, plan.output_tokens)] * plan.repeats, 1)
    for conc in plan.concurrency_levels:
        if conc > 1 or plan.decode_prompt_len not in plan.prompt_lens:
            shapes = [(plan.decode_prompt_len, plan.output_tokens)] * (conc * plan.repeats)
            point(f"len={plan.decode_prompt_len} c={conc}", shapes, conc)
    return points


def interference_requests(
    plan: ProbePlan, maker: PromptMaker, sweep: Sequence[RequestTrace], max_seq_len: int
) -> list[ProbeRequest]:
    """Short streams that start together, then long prompts injected while they decode."""
    short, long_ = min(plan.prompt_lens), max(plan.prompt_lens)
    ok = [t for t in sweep if t.ok]
    itl = statistics.median([g for t in ok for g in t.itl_s()] or [0.05])
    # Servers count tokens their own way, so pick the longest prompts by what they reported.
    longest = max((t.prompt_tokens for t in ok), default=0)
    ttft_long = statistics.median([t.ttft_s or 0.0 for t in ok if t.prompt_tokens == longest])
    shortest = min((t.prompt_tokens for t in ok), default=0)
    # The median: one slow first token in the sweep (a busy machine) must not push the long
    # prompts past the streams' end.
    ttft_short = statistics.median([t.ttft_s or 0.0 for t in ok if t.prompt_tokens == shortest]
                                   or [0.0])
    n_streams = min(4, max(plan.concurrency_levels))
    # The streams are well into decode by then, even on a server whose TTFT dwarfs its ITL
    # (a big remote model, or one that prefills the streams one after another).
    offset_s = n_streams * ttft_short + 10 * itl
    n_inject, gap_s = 2, 1.5 * ttft_long
    span_s = offset_s + n_inject * gap_s + 10 * itl
    room = max(2, max_seq_len - short - 1)
    stream_tokens = max(32, min(room, 1024, math.ceil(span_s / max(itl, 1e-4))))
    life_s = stream_tokens * itl
    if span_s > life_s:  # the context caps the streams: inject within their first two thirds
        offset_s, gap_s = min(offset_s, life_s / 3), min(gap_s, life_s / 6)
    reqs = []
    for _ in range(n_streams):
        ids, text = maker.make(short)
        reqs.append(ProbeRequest(ids, text, stream_tokens, "interference", 0, "stream"))
    for i in range(n_inject):
        ids, text = maker.make(long_)
        start = offset_s + i * gap_s
        reqs.append(ProbeRequest(ids, text, 2, "interference", 0, "inject", start))
    return [replace(r, concurrency=len(reqs)) for r in reqs]


@dataclass
class ProbeResult:
    """Every trace of a probe run (warm-up excluded) and how long it took."""

    plan: ProbePlan
    traces: list[RequestTrace]
    duration_s: float


def run_probe(
    target: Target, plan: ProbePlan, max_seq_len: int, progress: bool = True
) -> ProbeResult:
    """Run the sweep (and the interference probe where the target streams concurrently)."""
    from tqdm import tqdm

    maker = PromptMaker(target.codec())
    points = sweep_points(plan, maker)
    interfere = plan.interference and bool(target.describe().get("concurrent_streams"))
    start_s = time.perf_counter()
    # First calls at a new shape pay for allocation and kernel selection (stalls of hundreds of
    # ms were seen on the first decode steps): run each prompt length once, untimed, through a
    # full-length output, and the widest batch once.
    lengths = [p for p, _ in plan.workload] or list(plan.prompt_lens)
    for n in sorted(set(lengths))[:8]:
        ids, text = maker.make(n)
        target.run([ProbeRequest(ids, text, plan.output_tokens, "warmup")], 1)
    widest = max(plan.concurrency_levels)
    warm = [ProbeRequest(*maker.make(plan.decode_prompt_len), plan.output_tokens, "warmup")
            for _ in range(widest)]
    target.run(warm, widest)
    traces: list[RequestTrace] = []
    bar = tqdm(total=len(points) + interfere, desc="probing", unit="point", disable=not progress)
    with bar:
        for conc, reqs in points:
            bar.set_postfix_str(reqs[0].point)
            traces += target.run(reqs, conc)
            bar.update()
        if interfere:
            bar.set_postfix_str("prefill interference")
            reqs = interference_requests(plan, maker, traces, max_seq_len)
            traces += target.run(reqs, len(reqs))
            bar.update()
    return ProbeResult(plan, traces, time.perf_counter() - start_s)
