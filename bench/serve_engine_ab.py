"""The server's engine on a thread against in its own process, and offline, side by side.

Two servers (`splitphase serve --no-engine-process` and `--engine-process`) on the same model
and the same closed-loop load as `bench/serve_load.py` (one level), then the same requests
through offline `LLM.generate`; the three alternate for `--rounds` rounds, so a burst of other
work on a shared machine lands on all of them. Prints each side's best and median throughput
over offline's (the best of each, as serve_load does; the median of the per-round ratios) and
CPU microseconds per output token (event loop, engine, clients).

    python bench/serve_engine_ab.py                     # embedded `small`, concurrency 16
    python bench/serve_engine_ab.py --quick             # random tiny checkpoint, 2 rounds
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
from pathlib import Path

from serve_load import prompts, run_offline_level, run_server_level, tiny_checkpoint

from splitphase.engine.llm import LLM
from splitphase.server.process import ServerProcess

MODES = {"engine thread": "--no-engine-process", "engine process": "--engine-process"}


def run(args: argparse.Namespace, model_name: str) -> dict:
    """Start one server per mode, alternate them with offline, return every round's numbers."""
    first = LLM(model_name, device="cpu", max_num_seqs=1)
    assert first.model is not None
    work = prompts(args.requests)
    serve_args = ["--model", model_name, "--policy", args.policy, "--device", "cpu",
                  "--max-num-seqs", str(args.level), "--hardware", "h100"]
    runs: dict[str, list[dict]] = {name: [] for name in [*MODES, "offline"]}
    with contextlib.ExitStack() as stack:
        servers = []
        for name, flag in MODES.items():
            proc = ServerProcess([*serve_args, flag])
            url = stack.enter_context(proc)
            assert proc.proc is not None
            servers.append((name, url, proc.proc.pid))
            run_server_level(url, work[:2], 1, args.max_tokens, 60.0)  # warm-up
        for _ in range(args.rounds):
            texts = {}
            for name, url, pid in servers:
                res, texts[name] = run_server_level(url, work, args.level, args.max_tokens,
                                                    300.0, pid)
                runs[name].append(res)
            off, off_texts = run_offline_level(first.model, first.tokenizer, args.policy, work,
                                               args.level, args.max_tokens)
            runs["offline"].append(off)
            for name in MODES:  # every server text is the offline greedy text
                assert all(texts[name].get(i) == t for i, t in enumerate(off_texts)), name
    return runs


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Best and median throughput over offline's, and median CPU per token, per side."""
    off = [r["output_tok_per_s"] for r in runs["offline"]]
    out = {}
    for name, rs in runs.items():
        tok_s = [r["output_tok_per_s"] for r in rs]
        out[name] = {
            "best_over_offline": max(tok_s) / max(off),
            "median_round_over_offline": statistics.median(
                s / o for s, o in zip(tok_s, off, strict=True)),
            "event_loop_cpu_us_per_tok": _median(rs, "event_loop_cpu_us_per_tok"),
            "engine_cpu_us_per_tok": _median(rs, "engine_cpu_us_per_tok"),
            "client_cpu_us_per_tok": _median(rs, "client_cpu_us_per_tok"),
        }
    return out


def _median(rs: list[dict], key: str) -> float | None:
    values = [r[key] for r in rs if r.get(key) is not None]
    return statistics.median(values) if values else None


def print_summary(summary: dict[str, dict]) -> None:
    print(f"{'side':>15} {'best/off':>8} {'median/off':>10} {'loop us/tok':>11} "
          f"{'engine us/tok':>13} {'clients us/tok':>14}")
    for name, s in summary.items():
        cols = [s["event_loop_cpu_us_per_tok"], s["engine_cpu_us_per_tok"],
                s["client_cpu_us_per_tok"]]
        loop, engine, client = ("-" if c is None else f"{c:.0f}" for c in cols)
        print(f"{name:>15} {s['best_over_offline']:>8.3f} {s['median_round_over_offline']:>10.3f}"
              f" {loop:>11} {engine:>13} {client:>14}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="embedded model or checkpoint dir (default: small)")
    p.add_argument("--level", type=int, default=16, help="concurrent clients")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--policy", default="chunked", choices=["mixed", "chunked"])
    p.add_argument("--quick", action="store_true", help="tiny checkpoint, 8 requests, 2 rounds")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" /
                                        "serve_engine_ab.json"))
    args = p.parse_args()
    if args.quick:
        args.level, args.requests, args.max_tokens, args.rounds = 4, 8, 8, 2
    with tempfile.TemporaryDirectory() as tmp:
        model_name = args.model or (tiny_checkpoint(Path(tmp)) if args.quick else "small")
        runs = run(args, model_name)
    summary = summarize(runs)
    print_summary(summary)
    doc = {"bench": "serve_engine_ab", "model": args.model or ("tiny" if args.quick else "small"),
           "level": args.level, "requests": args.requests, "max_tokens": args.max_tokens,
           "rounds": args.rounds, "summary": summary, "runs": runs}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
