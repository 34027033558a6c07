"""`splitphase generate`: a batch of prompts through the engine, timed per phase."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from typing import Any

from splitphase.engine.llm import LLM, Completion
from splitphase.engine.llm_engine import StepRecord
from splitphase.engine.sampling_params import SamplingParams, SamplingParamsError
from splitphase.errors import UserError


def _params(max_tokens: int, temperature: float, seed: int | None) -> SamplingParams:
    if max_tokens < 1:
        raise UserError(f"--max-tokens must be >= 1, got {max_tokens}")
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
    except SamplingParamsError as exc:
        raise UserError(str(exc)) from exc


def summarize(
    steps: list[StepRecord], completions: list[Completion], wall_s: float
) -> dict[str, Any]:
    """Per-phase totals of a run: steps, tokens, time, tokens/s."""
    phases: dict[str, dict[str, float]] = {}
    for s in steps:
        p = phases.setdefault(
            s.phase, {"steps": 0, "wall_s": 0.0, "prefill_tokens": 0, "decode_tokens": 0}
        )
        p["steps"] += 1
        p["wall_s"] += s.wall_s
        p["prefill_tokens"] += s.num_prefill_tokens
        p["decode_tokens"] += s.num_decode_seqs
    prefill_s = sum(p["wall_s"] for k, p in phases.items() if k in ("prefill", "mixed"))
    decode_s = phases.get("decode", {}).get("wall_s", 0.0)
    prompt_tokens = sum(s.num_prefill_tokens for s in steps)
    decode_tokens = phases.get("decode", {}).get("decode_tokens", 0)
    output_tokens = sum(len(c.token_ids) for c in completions)
    return {
        "requests": len(completions),
        "wall_s": wall_s,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / wall_s if wall_s > 0 else 0.0,
        "prefill_tokens_per_s": prompt_tokens / prefill_s if prefill_s > 0 else 0.0,
        "decode_tokens_per_s": decode_tokens / decode_s if decode_s > 0 else 0.0,
        "phases": phases,
    }


def generate(
    model_name: str,
    prompts: list[str],
    max_tokens: int,
    temperature: float,
    seed: int | None,
    as_json: bool,
    policy: str = "chunked",
    engine: dict[str, Any] | None = None,
    device: str = "auto",
    dtype: str | None = None,
) -> None:
    """Print completions and per-phase timing (or one JSON object); `engine`: EngineConfig
    fields beside the policy; `dtype`: the compute dtype (None: the checkpoint's)."""
    params = _params(max_tokens, temperature, seed)
    llm = LLM(model_name, device=device, dtype=dtype, policy=policy, **(engine or {}))
    t0 = time.perf_counter()
    completions = llm.generate(prompts, params)
    summary = summarize(llm.steps, completions, time.perf_counter() - t0)
    summary["dtype"] = llm.dtype
    if as_json:
        outputs = [
            {
                "prompt": c.prompt,
                "text": c.text,
                "token_ids": c.token_ids,
                "finish_reason": c.finish_reason,
                "timings": {k: v for k, v in asdict(c.timings).items() if k != "inter_token_s"},
            }
            for c in completions
        ]
        print(json.dumps({"outputs": outputs, "summary": summary}))
        return
    for c in completions:
        t = c.timings
        print(f"{c.prompt}\033[1m{c.text}\033[0m")
        print(
            f"  [{c.finish_reason}] queue {_ms(t.queue_s)}  prefill {_ms(t.prefill_s)}  "
            f"TTFT {_ms(t.ttft_s)}  decode {_ms(t.decode_s)}  TPOT {_ms(t.tpot_s)}\n"
        )
    print(
        f"policy {policy}: {summary['requests']} requests, {summary['output_tokens']} tokens in "
        f"{summary['wall_s']:.2f} s | prefill {summary['prefill_tokens_per_s']:,.0f} tok/s | "
        f"decode {summary['decode_tokens_per_s']:,.1f} tok/s"
    )


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"
