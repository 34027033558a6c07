"""Server load sweep: `splitphase serve` against offline `LLM.generate`, side by side.

For each concurrency level, `level` closed-loop clients (one keep-alive connection and one
stream each at a time; `bench/sse_client.py`) send the same N greedy requests (a fixed prompt
set, `max_tokens` tokens each with `ignore_eos`) to a server this script starts on 127.0.0.1.
Client-side TTFT is the time from sending a request to its first SSE chunk (which carries the
first token); ITL is the gap between consecutive chunks. The same N requests then run
in-process through `LLM(model).generate` with `max_num_seqs=level`, the batch width the clients
allow the server, and the table prints the server's throughput over offline's at each level
(issue 10's target: overhead under 10% at concurrency 16). The clients share the machine with
the server, so they do the least per chunk while streaming (they read one HTTP chunk and note
its arrival time, on uvloop); events are parsed after each stream, and every completed text is
still checked against the offline greedy text (`same text`). Server and offline runs alternate
(`--repeats`) and the fastest of each side is compared. A second table gives CPU time per
output token (server event loop, server engine threads, clients, offline engine), which,
unlike tok/s, does not move with whatever else the machine runs.

    python bench/serve_load.py                        # embedded `small`, levels 1 4 16 64
    python bench/serve_load.py --quick                # random tiny checkpoint, levels 1 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch
import uvloop
from sse_client import Connection

from splitphase.engine.llm import LLM
from splitphase.engine.sampling_params import SamplingParams
from splitphase.model.checkpoint import save_checkpoint
from splitphase.model.config import ModelConfig
from splitphase.model.tokenizer import Tokenizer
from splitphase.model.transformer import Transformer
from splitphase.server.process import ServerProcess
from splitphase.training.trainer import pick_device

TOPICS = ["the weather", "a small engine", "paged attention", "the river", "prefill and decode",
          "a quiet city", "cache blocks", "the last train"]


def prompts(n: int) -> list[str]:
    """A fixed prompt set of mixed lengths, the same for the server and offline."""
    return [f"Request {i} is about {TOPICS[i % len(TOPICS)]}:" + " and so on" * (i % 5)
            for i in range(n)]


def pct(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile; None for no samples."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summary(wall_s: float, n: int, tokens: int, ttft: list[float], itl: list[float]) -> dict:
    """Rates and latency percentiles of one run."""
    return {"wall_s": wall_s, "requests": n, "output_tokens": tokens,
            "req_per_s": n / wall_s, "output_tok_per_s": tokens / wall_s,
            "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99),
            "itl_p50_s": pct(itl, 0.5), "itl_p99_s": pct(itl, 0.99)}


@dataclass
class Stream:
    """What one streamed request saw, client-side."""

    text: str = ""
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None


async def stream_one(conn: Connection, prompt: str, max_tokens: int) -> Stream:
    """Send one streaming completion; time its chunks as they come, parse them afterwards."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    out, parts, last = Stream(), [], 0.0
    raw = await conn.post("/v1/completions", body)
    if raw.status != 200:
        out.error = f"HTTP {raw.status}"
        return out
    for at_s, msg in raw.events():
        if "error" in msg:
            out.error = msg["error"]["message"]
        elif msg["choices"]:
            if out.ttft_s is None:
                out.ttft_s = at_s - raw.sent_s
            else:
                out.gaps_s.append(at_s - last)
            last = at_s
            parts += [c["text"] for c in msg["choices"]]
        elif msg.get("usage"):
            out.tokens = msg["usage"]["completion_tokens"]
    out.text = "".join(parts)
    return out


async def closed_loop(url: str, work: list[str], level: int, max_tokens: int,
                      deadline_s: float) -> tuple[float, list[Stream | None]]:
    """`level` clients drain the work list; none starts a request after the deadline."""
    results: list[Stream | None] = [None] * len(work)
    todo = iter(range(len(work)))
    host, port = httpx.URL(url).host, httpx.URL(url).port or 80
    conns = [Connection(host, port) for _ in range(level)]
    t0 = time.perf_counter()

    async def client_loop(conn: Connection) -> None:
        for i in todo:  # one shared iterator: each index goes to exactly one client
            if time.perf_counter() - t0 > deadline_s:
                return
            results[i] = await stream_one(conn, work[i], max_tokens)

    try:
        await asyncio.gather(*(client_loop(c) for c in conns))
        return time.perf_counter() - t0, results
    finally:
        for conn in conns:
            await conn.close()


def _stat_cpu_s(path: str) -> float:
    """utime + stime of a /proc stat file, in seconds."""
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_s(pid: int) -> tuple[float, float] | None:
    """CPU seconds of a process so far: (its main thread, all its other threads and its child
    processes); Linux only.

    The server's main thread runs the event loop (HTTP, SSE); the rest is the engine: its
    thread (and the tokenizer's worker threads), or with --engine-process, the thread that
    talks to the engine core plus the core process itself.
    """
    main_s, other_s = 0.0, 0.0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            cpu_s = _stat_cpu_s(f"/proc/{pid}/task/{tid}/stat")
            if int(tid) == pid:
                main_s += cpu_s
            else:
                other_s += cpu_s
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                other_s += sum(_stat_cpu_s(f"/proc/{child}/stat") for child in f.read().split())
    except OSError:
        return None
    return main_s, other_s


def run_server_level(url: str, work: list[str], level: int, max_tokens: int,
                     deadline_s: float,
                     server_pid: int | None = None) -> tuple[dict, dict[int, str]]:
    """One level against the server: its summary and each completed request's text."""
    cpu0 = thread_cpu_s(server_pid) if server_pid is not None else None
    client0_s = time.process_time()
    # The clients' own loop on uvloop too: less of the shared cores goes to the clients.
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        wall, results = runner.run(closed_loop(url, work, level, max_tokens, deadline_s))
    client_s = time.process_time() - client0_s
    cpu1 = thread_cpu_s(server_pid) if server_pid is not None else None
    done = [r for r in results if r is not None and r.error is None]
    res = summary(wall, len(done), sum(r.tokens for r in done),
                  [r.ttft_s for r in done if r.ttft_s is not None],
                  [g for r in done for g in r.gaps_s])
    chunks = sum(1 + len(r.gaps_s) for r in done if r.ttft_s is not None)
    res["tokens_per_chunk"] = res["output_tokens"] / chunks if chunks else None
    res["errors"] = sum(1 for r in results if r is not None and r.error is not None)
    res["not_started"] = sum(1 for r in results if r is None)
    tokens = max(1, res["output_tokens"])
    # CPU per token does not depend on what else the machine runs (unlike tok/s): it says
    # where the server's extra work goes.
    res["client_cpu_us_per_tok"] = 1e6 * client_s / tokens
    if cpu0 is not None and cpu1 is not None:
        res["event_loop_cpu_us_per_tok"] = 1e6 * (cpu1[0] - cpu0[0]) / tokens
        res["engine_cpu_us_per_tok"] = 1e6 * (cpu1[1] - cpu0[1]) / tokens
    return res, {i: r.text for i, r in enumerate(results) if r is not None and r.error is None}


def run_offline_level(model: Transformer, tok: Tokenizer, policy: str, work: list[str],
                      level: int, max_tokens: int) -> tuple[dict, list[str]]:
    """The same requests through `LLM.generate`, at most `level` running at once."""
    llm = LLM(model, tok, policy=policy, max_num_seqs=level)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    t0, cpu0_s = time.perf_counter(), time.process_time()
    outs = llm.generate(work, params)
    wall, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0_s
    res = summary(wall, len(outs), sum(len(o.token_ids) for o in outs),
                  [o.timings.ttft_s for o in outs if o.timings.ttft_s is not None],
                  [g for o in outs for g in o.timings.inter_token_s])
    res["engine_cpu_us_per_tok"] = 1e6 * cpu_s / max(1, res["output_tokens"])
    return res, [o.text for o in outs]


def tiny_checkpoint(root: Path) -> str:
    """A random tiny model (2 layers, width 64) saved under root."""
    torch.manual_seed(0)
    cfg = ModelConfig.from_name("tiny").with_(vocab_size=Tokenizer.default().vocab_size)
    return str(save_checkpoint(Transformer(cfg), root))


def model_label(quick: bool) -> str:
    return "random tiny checkpoint" if quick else "small"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.1f}"


def print_table(rows: list[dict]) -> None:
    """One line per level: server, offline and their ratio side by side."""
    head = (f"{'conc':>4} {'reqs':>5} {'srv req/s':>9} {'srv tok/s':>9} {'off tok/s':>9} "
            f"{'srv/off':>7} {'ovh %':>6} {'TTFT p50/p99 ms':>16} {'ITL p50/p99 ms':>15} "
            f"{'off ITL p50 ms':>14} {'match':>5}")
    print(head)
    print("-" * len(head))
    for r in rows:
        s, o = r["server"], r["offline"]
        ttft = f"{_ms(s['ttft_p50_s'])}/{_ms(s['ttft_p99_s'])}"
        itl = f"{_ms(s['itl_p50_s'])}/{_ms(s['itl_p99_s'])}"
        print(f"{r['level']:>4} {s['requests']:>5} {s['req_per_s']:>9.2f} "
              f"{s['output_tok_per_s']:>9.1f} {o['output_tok_per_s']:>9.1f} "
              f"{r['throughput_ratio']:>7.3f} {100 * r['overhead_frac']:>6.1f} {ttft:>16} "
              f"{itl:>15} {_ms(o['itl_p50_s']):>14} {r['text_match_frac']:>5.2f}")


def print_cpu_table(rows: list[dict]) -> None:
    """CPU microseconds per output token, by where they were spent (the kept runs)."""
    print(f"{'conc':>4} {'srv loop us/tok':>15} {'srv engine us/tok':>17} "
          f"{'clients us/tok':>14} {'off engine us/tok':>17}")
    for r in rows:
        s, o = r["server"], r["offline"]
        loop, engine = s.get("event_loop_cpu_us_per_tok"), s.get("engine_cpu_us_per_tok")
        print(f"{r['level']:>4} {'-' if loop is None else f'{loop:.0f}':>15} "
              f"{'-' if engine is None else f'{engine:.0f}':>17} "
              f"{s['client_cpu_us_per_tok']:>14.0f} {o['engine_cpu_us_per_tok']:>17.0f}")


def sweep(args: argparse.Namespace, model_name: str) -> dict:
    """Start the server, run every level there and offline, return the JSON document."""
    device = pick_device(args.device)
    first = LLM(model_name, device=str(device), max_num_seqs=1)  # loads model and tokenizer
    assert first.model is not None
    model, tok = first.model, first.tokenizer
    work = prompts(args.requests)
    serve_args = ["--model", model_name, "--policy", args.policy, "--device", str(device),
                  "--max-num-seqs", str(max(args.levels)), "--hardware", args.hardware,
                  "--engine-process" if args.engine_process else "--no-engine-process"]
    rows = []
    server = ServerProcess(serve_args, host="127.0.0.1")
    with server as url:
        pid = server.proc.pid if server.proc is not None else None
        run_server_level(url, work[:2], 1, args.max_tokens, args.level_timeout_s)  # warm-up
        run_offline_level(model, tok, args.policy, work[:2], 1, args.max_tokens)
        for level in args.levels:
            # Server and offline alternate and each keeps its fastest run: on a shared machine
            # a burst of other work then cannot land on one side only and fake an overhead.
            srv_runs, off_runs = [], []
            for _ in range(args.repeats):
                srv_runs.append(run_server_level(url, work, level, args.max_tokens,
                                                 args.level_timeout_s, pid))
                done = sorted(srv_runs[-1][1])  # offline runs the requests the server finished
                off, off_texts = run_offline_level(model, tok, args.policy,
                                                   [work[i] for i in done], level,
                                                   args.max_tokens)
                off_runs.append((off, dict(zip(done, off_texts, strict=True))))
            srv, srv_texts = max(srv_runs, key=lambda r: r[0]["output_tok_per_s"])
            off, off_by_id = max(off_runs, key=lambda r: r[0]["output_tok_per_s"])
            ratio = srv["output_tok_per_s"] / off["output_tok_per_s"]
            match = sum(srv_texts.get(i) == t for i, t in off_by_id.items())
            rows.append({"level": level, "server": srv, "offline": off,
                         "throughput_ratio": ratio, "overhead_frac": 1.0 - ratio,
                         "text_match_frac": match / max(1, len(off_by_id))})
    return {"bench": "serve_load", "model": args.model or model_label(args.quick),
            "policy": args.policy, "engine_process": args.engine_process,
            "device": str(device), "torch_threads": torch.get_num_threads(),
            "requests_per_level": args.requests, "max_tokens": args.max_tokens,
            "repeats": args.repeats,
            "levels": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="embedded model or checkpoint dir (default: small; "
                   "--quick: a random tiny checkpoint)")
    p.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--requests", type=int, default=128, help="requests per level")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3,
                   help="server and offline runs per level, alternated; the fastest of each "
                   "is reported")
    p.add_argument("--policy", default="chunked", choices=["mixed", "chunked"])
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="the server's engine in its own process, as `serve` does by default "
                   "(--no-engine-process: on a thread)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda (server and offline)")
    p.add_argument("--hardware", default="h100",
                   help="peaks for the server's utilization gauges (a table name skips the "
                   "CPU calibration at startup; the gauges are not measured here)")
    p.add_argument("--level-timeout-s", type=float, default=300.0,
                   help="no new request starts after this long at one level")
    p.add_argument("--quick", action="store_true", help="levels 1 4, 8 requests, 8 tokens")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "serve_load.json"))
    args = p.parse_args()
    if args.quick:
        args.levels, args.requests, args.max_tokens, args.repeats = [1, 4], 8, 8, 1
        args.level_timeout_s = min(args.level_timeout_s, 20.0)
    if min(args.levels) < 1 or min(args.requests, args.max_tokens, args.repeats) < 1:
        p.error("--levels, --requests, --max-tokens and --repeats must be >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        model_name = args.model or (tiny_checkpoint(Path(tmp)) if args.quick else "small")
        t0 = time.perf_counter()
        doc = sweep(args, model_name)
        doc["total_s"] = time.perf_counter() - t0
    print_table(doc["levels"])
    print_cpu_table(doc["levels"])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out} ({doc['total_s']:.1f} s)")


if __name__ == "__main__":
    main()
