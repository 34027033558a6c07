"""Soak: a long open-loop mix of well-behaved and badly-behaved clients; nothing may be lost.

Requests arrive as a Poisson process at `--rate` for `--duration-s` against `splitphase serve`
on 127.0.0.1 (the embedded `small`; `--quick`: a random tiny checkpoint for a few seconds).
Each arrival is one of (weights in KINDS):

    stream      streaming completion, raw SSE bytes checked (events whole, [DONE] last)
    plain       non-streamed completion
    disconnect  streaming, the client leaves after the first event
    timeout     non-streamed (4x the tokens), the client gives up after 0.05 s
    hostile     a malformed or out-of-range body (must be a 400 in OpenAI error shape)

A stream or plain request is held if it got a full response or an explicit 429/503 or error
event; anything else is lost. Afterwards the server must come to rest (no request running or
waiting, no KV block used) and answer a fresh request. Prints a table; `--ledger PATH` adds
the run to the reliability ledger (tools/reliability_report.py renders it into the README).

    python bench/soak.py                       # small, 60 s at 20 req/s
    python bench/soak.py --duration-s 600 --rate 30
    python bench/soak.py --quick               # tiny checkpoint, 5 s
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import torch

from splitphase.model.checkpoint import save_checkpoint
from splitphase.model.config import ModelConfig
from splitphase.model.tokenizer import Tokenizer
from splitphase.model.transformer import Transformer
from splitphase.reliability.ledger import Ledger
from splitphase.reliability.loadgen import arrival_times, percentile, stream_request
from splitphase.reliability.probe import wait_at_rest
from splitphase.server.process import ServerProcess

KINDS = {"stream": 0.55, "plain": 0.15, "disconnect": 0.1, "timeout": 0.1, "hostile": 0.1}
HOSTILE = [b'{"prompt": "x",', b'{"prompt": "x", "max_tokens": -3}',
           b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "\\ud800"}',
           b'{"prompt": [1, 99999999]}', b'{"prompt": "x", "n": 1000}',
           b'{"prompt": "x", "max_tokens": "many"}', b'{"messages": []}']


def body(i: int, max_tokens: int, stream: bool) -> dict[str, Any]:
    """A greedy completion of a varied prompt."""
    return {"prompt": f"Soak request {i}:" + " and so on" * (i % 6), "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream}


async def one(client: httpx.AsyncClient, url: str, kind: str, i: int,
              max_tokens: int) -> dict[str, Any]:
    """Send one request of `kind`; returns {kind, outcome, ttft_s, gaps_s}."""
    api = url + "/v1/completions"
    rec: dict[str, Any] = {"kind": kind, "ttft_s": None, "gaps_s": []}
    try:
        if kind == "stream":
            out = await stream_request(client, api, body(i, max_tokens, True))
            rec.update(ttft_s=out.ttft_s, gaps_s=out.gaps_s)
            rec["outcome"] = ("completed" if out.completed else "refused" if out.refused
                              else "error event" if out.explicit_error else "LOST")
        elif kind == "disconnect":
            async with client.stream("POST", api, json=body(i, max_tokens, True)) as resp:
                async for _ in resp.aiter_raw():
                    break
            rec["outcome"] = "left"
        elif kind == "hostile":
            resp = await client.post(api, content=HOSTILE[i % len(HOSTILE)],
                                     headers={"Content-Type": "application/json"})
            shaped = resp.status_code == 400 and set(resp.json()["error"]) == {
                "message", "type", "param", "code"}
            rec["outcome"] = "rejected 400" if shaped else "LOST"
        else:
            timeout = 0.05 if kind == "timeout" else None  # 4x the tokens: it gives up
            n_tokens = 4 * max_tokens if kind == "timeout" else max_tokens
            resp = await client.post(api, json=body(i, n_tokens, False),
                                     timeout=timeout or client.timeout)
            finished = resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"]
            rec["outcome"] = ("completed" if finished else "refused"
                              if resp.status_code in (429, 503) else "LOST")
    except httpx.TimeoutException:
        rec["outcome"] = "gave up" if kind == "timeout" else "LOST"
    except httpx.HTTPError as exc:
        rec["outcome"] = "LOST"
        rec["error"] = repr(exc)
    return rec


async def soak(url: str, duration_s: float, rate_per_s: float, max_tokens: int,
               seed: int) -> tuple[list[dict[str, Any]], float]:
    """The open-loop run: every arrival sent at its time, all awaited at the end."""
    n = max(1, int(duration_s * rate_per_s))
    offsets = [t for t in arrival_times(n, rate_per_s, True, seed) if t <= duration_s]
    rng = random.Random(seed)
    kinds = rng.choices(list(KINDS), weights=list(KINDS.values()), k=len(offsets))
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        t0 = time.perf_counter()

        async def at(offset_s: float, kind: str, i: int) -> dict[str, Any]:
            await asyncio.sleep(max(0.0, t0 + offset_s - time.perf_counter()))
            return await one(client, url, kind, i, max_tokens)

        recs = await asyncio.gather(*(at(o, k, i) for i, (o, k) in
                                      enumerate(zip(offsets, kinds, strict=True))))
        return list(recs), time.perf_counter() - t0


def table(recs: list[dict[str, Any]]) -> list[str]:
    """Per kind: sent and outcomes; for streams, client-side TTFT and ITL percentiles."""
    lines = [f"{'kind':<11} {'sent':>5}  outcomes"]
    for kind in KINDS:
        mine = [r for r in recs if r["kind"] == kind]
        counts = Counter(r["outcome"] for r in mine)
        shown = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        lines.append(f"{kind:<11} {len(mine):>5}  {shown}")
    ttft = [r["ttft_s"] for r in recs if r["kind"] == "stream" and r["ttft_s"] is not None]
    itl = [g for r in recs if r["kind"] == "stream" for g in r["gaps_s"]]
    lines.append(f"streams: TTFT p50/p99 {_ms(percentile(ttft, 0.5))}/"
                 f"{_ms(percentile(ttft, 0.99))} ms, ITL p50/p99 {_ms(percentile(itl, 0.5))}/"
                 f"{_ms(percentile(itl, 0.99))} ms")
    return lines


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model to serve (default: small; --quick: random tiny)")
    p.add_argument("--duration-s", type=float, default=60.0)
    p.add_argument("--rate", type=float, default=20.0, help="arrivals per second (Poisson)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-queue", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny checkpoint, 5 s at 20/s")
    p.add_argument("--ledger", help="merge this run into a reliability ledger JSON")
    args = p.parse_args()
    if args.quick:
        args.duration_s, args.rate, args.max_tokens = 5.0, 20.0, 8
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or (_tiny(Path(tmp)) if args.quick else "small")
        serve = ["--model", model, "--hardware", "h100", "--max-num-seqs",
                 str(args.max_num_seqs), "--max-queue", str(args.max_queue)]
        with ServerProcess(serve, host="127.0.0.1", env={"OMP_NUM_THREADS": "1"}) as url:
            recs, wall_s = asyncio.run(soak(url, args.duration_s, args.rate, args.max_tokens,
                                            args.seed))
            metrics, rest_s = wait_at_rest(url, 30)
            fresh = httpx.post(url + "/v1/completions", json=body(-1, 4, False), timeout=60)
    lost = sum(r["outcome"] == "LOST" for r in recs)
    at_rest = metrics["kv_cache_blocks_used"] == 0 and metrics["num_requests_running"] == 0
    lines = [f"soak: {len(recs)} requests over {wall_s:.1f} s (Poisson {args.rate:g}/s), "
             f"model {args.model or ('tiny' if args.quick else 'small')}", *table(recs),
             f"at rest {rest_s:.1f} s after the last answer: {at_rest}; fresh request: "
             f"{fresh.status_code}; requests lost: {lost}"]
    print("\n".join(lines))
    ok = lost == 0 and at_rest and fresh.status_code == 200
    if args.ledger:
        _record(args, recs, wall_s, lost, ok)
    return 0 if ok else 1


def _record(args: argparse.Namespace, recs: list[dict[str, Any]], wall_s: float, lost: int,
            ok: bool) -> None:
    counts = Counter(r["outcome"] for r in recs)
    book = Ledger()
    book.record("load", f"soak: {args.duration_s:g} s of mixed clients (bench/soak.py)",
                f"{len(recs)} requests in {wall_s:.0f} s: " + ", ".join(
                    f"{k} {v}" for k, v in sorted(counts.items()))
                + ("; server at rest after" if ok else "; FAILED"),
                held=sum(counts.get(k, 0) for k in ("completed", "refused", "error event",
                                                     "rejected 400")), lost=lost,
                bad_inputs=counts.get("rejected 400", 0),
                faults=counts.get("left", 0) + counts.get("gave up", 0),
                figures={"recs": len(recs), "wall_s": wall_s, "outcomes": dict(counts)})
    book.write(args.ledger)


def _tiny(root: Path) -> str:
    torch.manual_seed(0)
    cfg = ModelConfig.from_name("tiny").with_(vocab_size=Tokenizer.default().vocab_size)
    return str(save_checkpoint(Transformer(cfg), root))


if __name__ == "__main__":
    sys.exit(main())
