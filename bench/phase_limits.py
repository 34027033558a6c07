"""Decode against the memory's speed, prefill against the matmul peak, side by side.

One run on one machine: the peaks (STREAM triad bandwidth, matmul FLOP/s at the model's
shapes) are measured with the same thread count as everything else, then for each dtype our
decode (batch 1 and 8 at a filled context) and prefill (512 and 2048 tokens), the same weights
through transformers' `generate` and through llama.cpp (GGUF written by our exporter), our
engine at 32 concurrent requests against one, and the effect of the native decode kernel.
Figures are the best of several runs (see splitphase.perf.timing); ratios come from this
run. Where the host's memory speed moves between minutes, two figures are also taken in
alternating bursts with their yardstick, in one process: the batch-1 step against a triad
pass (`decode_bw_fraction_b1_interleaved`), against a read-only pass (a sum: the step's own
kind of traffic, `decode_read_fraction_b1_interleaved`) and against llama.cpp's step
(`speedup_vs_llamacpp_decode_b1_interleaved`), the first prefill against the model's gate/up
GEMM at its row count (`prefill_flops_fraction_512_interleaved`: the peak, the best of many
shapes and rounds, catches the fastest spell of the run, a few prefills may not). Nothing
here is asserted.

    OMP_NUM_THREADS=2 python bench/phase_limits.py                 # base-125m, fp32 and bf16
    python bench/phase_limits.py --quick                           # tiny preset: proves it runs
    python bench/phase_limits.py --compile ...                     # + torch.compile rows
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from splitphase.hardware.cpuinfo import cpu_model_name
from splitphase.hardware.memory import keep_freed_memory
from splitphase.kernels import amx, build, gemm_choice, packed_linear, prefill_attention, skinny
from splitphase.model import compiled
from splitphase.model.config import ModelConfig
from splitphase.model.transformer import Transformer
from splitphase.perf import batching
from splitphase.perf.fractions import best_of_rounds, derive_fractions
from splitphase.perf.hf_baseline import hf_llama, time_hf
from splitphase.perf.llamacpp_baseline import llama_cpp_module, time_llamacpp
from splitphase.perf.peaks import (
    gemm_pass,
    measure_peaks,
    read_pass,
    triad_pass,
)
from splitphase.perf.timing import (
    decode_step_fn,
    interleaved_best_s,
    prefill_fn,
    time_decode,
    time_prefill,
    time_step_overhead,
)


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--preset", default="base-125m")
    ap.add_argument("--dtypes", nargs="+", default=None, help="default: float32 bfloat16 (CPU)")
    ap.add_argument("--threads", type=int, default=None, help="default: $OMP_NUM_THREADS or all")
    ap.add_argument("--context", type=int, default=512, help="cached tokens per decode row")
    ap.add_argument("--prefill", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--steps", type=int, default=24, help="timed decode steps per figure")
    ap.add_argument("--concurrent", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3, help="repeat everything; best per figure")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-llamacpp", action="store_true")
    ap.add_argument("--quick", action="store_true", help="tiny preset, tiny sizes")
    ap.add_argument("--compile", action="store_true",
                    help="also time the passes through torch.compile (splitphase.model.compiled)")
    ap.add_argument("--out", default="bench/results/phase_limits.json")
    args = ap.parse_args()
    if args.quick:
        args.preset, args.context, args.prefill, args.steps = "tiny", 32, [64, 128], 4
        args.concurrent, args.rounds = 8, 1
    if args.concurrent < 2:
        ap.error(f"--concurrent is the batching run's request count, >= 2; got {args.concurrent}")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dtypes is None:
        args.dtypes = ["bfloat16"] if args.device == "cuda" else ["float32", "bfloat16"]
    return args


def _threads(requested: int | None) -> int:
    n = requested or int(os.environ.get("OMP_NUM_THREADS", "0") or 0) or (os.cpu_count() or 1)
    torch.set_num_threads(n)
    return torch.get_num_threads()


def _model(preset: str, dtype: str, device: str) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig.from_name(preset).with_(dtype=dtype)).to(device).eval()


def _ours_raw(model: Transformer, args: argparse.Namespace) -> dict[str, Any]:
    """Our timings for one dtype: decode b1/b8 with native kernels on and off, prefill."""
    out: dict[str, Any] = {}
    for on, suffix in ((True, ""), (False, "_native_off")):
        skinny.set_enabled(on)
        try:
            for batch in (1, 8):
                d = time_decode(model, batch, args.context, args.steps)
                out[f"decode_b{batch}{suffix}"] = {
                    "batch": batch, "step_s": d.step_s, "bytes_per_step": d.bytes_per_step
                }
        finally:
            skinny.set_enabled(True)
    # The step, a triad pass and a read-only pass in alternating bursts: on a host whose memory
    # speed moves between minutes, the peaks measured before the step are not the machine it met.
    mib = 32 if args.quick else 256
    (triad, triad_bytes), (read, read_bytes) = triad_pass(model.device, mib), read_pass(
        model.device, 3 * mib)
    both = interleaved_best_s(
        {"step": decode_step_fn(model, 1, args.context), "triad": triad, "read": read},
        max(1, args.steps // 4),
    )
    out["interleaved_b1_triad"] = {
        "step_s": both["step"], "triad_pass_s": both["triad"], "triad_bytes_per_pass": triad_bytes,
        "read_pass_s": both["read"], "read_bytes_per_pass": read_bytes,
    }
    del triad, read
    out["decode_overhead_s_b1"] = time_step_overhead(
        model.cfg, args.steps, model.device, model.dtype
    )
    for n in args.prefill:
        seconds, flops = time_prefill(model, n, 2 if n > 1024 else 3)
        out[f"prefill_{n}"] = {"s": seconds, "flops": flops, "tokens": n}
    # The first prefill and the gate/up GEMM in alternating bursts, as the step and the triad.
    n = args.prefill[0]
    gemm, gemm_flops = gemm_pass(model.cfg, model.dtype, n, model.device)
    both = interleaved_best_s({"prefill": prefill_fn(model, n), "gemm": gemm}, 2, burst=2)
    out[f"interleaved_prefill_{n}_gemm"] = {"prefill_s": both["prefill"], "gemm_s": both["gemm"],
                                            "prefill_flops": out[f"prefill_{n}"]["flops"],
                                            "gemm_flops": gemm_flops}
    if args.compile:
        out.update(_compiled_raw(model, args))
    return out


def _compiled_raw(model: Transformer, args: argparse.Namespace) -> dict[str, Any]:
    """The same decode and first prefill through the compiled passes, and the wall seconds
    of the first calls (what compiling their graphs cost; later rounds find them cached)."""
    out: dict[str, Any] = {}
    n = args.prefill[0]
    compiled.PIECES.reset()  # every round compiles afresh: its first calls time the compile
    with compiled.switched(True):
        t0 = time.perf_counter()
        time_prefill(model, n, 1)  # compiles the prefill graphs
        for batch in (1, 8):
            time_decode(model, batch, args.context, 1)  # compiles this batch's decode graphs
        out["compile_first_calls_s"] = time.perf_counter() - t0
        for batch in (1, 8):
            d = time_decode(model, batch, args.context, args.steps)
            out[f"decode_b{batch}_compiled"] = {
                "batch": batch, "step_s": d.step_s, "bytes_per_step": d.bytes_per_step
            }
        seconds, flops = time_prefill(model, n, 2 if n > 1024 else 3)
        out[f"prefill_{n}_compiled"] = {"s": seconds, "flops": flops, "tokens": n}
    return out


def _baselines(model: Transformer, args: argparse.Namespace, threads: int) -> dict:
    """transformers and llama.cpp at batch-1 decode and the first prefill length."""
    out: dict[str, Any] = {}
    n = args.prefill[0]
    if not args.skip_hf:
        hf = hf_llama(model)
        out["transformers"] = (
            "transformers is not installed"
            if hf is None
            else time_hf(hf, model.cfg.vocab_size, args.context, args.steps, n, 3)
        )
        del hf
    if not args.skip_llamacpp and model.device.type == "cpu":
        with tempfile.TemporaryDirectory() as tmp:
            out["llamacpp"] = time_llamacpp(
                model, Path(tmp), threads, args.context, args.steps, n, 3,
                ours_decode=decode_step_fn(model, 1, args.context),
            )
    return out


def _ratios(ours: dict, base: dict, n: int) -> dict[str, float | None]:
    def ratio(name: str, key: str, mine: float) -> float | None:
        other = base.get(name)
        return other[key] / mine if isinstance(other, dict) else None

    return {
        "speedup_vs_transformers_decode_b1": ratio(
            "transformers", "decode_step_s_b1", ours["decode_b1"]["step_s"]
        ),
        "speedup_vs_transformers_prefill_512": ratio(
            "transformers", "prefill_s", ours[f"prefill_{n}"]["s"]
        ),
        "speedup_vs_llamacpp_decode_b1": ratio(
            "llamacpp", "decode_step_s_b1", ours["decode_b1"]["step_s"]
        ),
        # Both steps in alternating bursts: the host's minute cancels out (llamacpp_baseline).
        "speedup_vs_llamacpp_decode_b1_interleaved": ratio(
            "llamacpp", "decode_step_s_b1_interleaved",
            base["llamacpp"]["ours_decode_step_s_b1_interleaved"],
        ) if isinstance(base.get("llamacpp"), dict) else None,
        "speedup_vs_llamacpp_prefill_512": ratio(
            "llamacpp", "prefill_s", ours[f"prefill_{n}"]["s"]
        ),
        "native_kernel_speedup_decode_b1": ours["decode_b1_native_off"]["step_s"]
        / ours["decode_b1"]["step_s"],
        "native_kernel_speedup_decode_b8": ours["decode_b8_native_off"]["step_s"]
        / ours["decode_b8"]["step_s"],
        **_compile_ratios(ours, n),
    }


def _compile_ratios(ours: dict, n: int) -> dict[str, float]:
    """As-is time over compiled time (>1: compiling helps), when --compile ran."""
    keys = ["decode_b1", "decode_b8", f"prefill_{n}"]
    return {f"compile_speedup_{k}": ours[k].get("step_s", ours[k].get("s")) / ours[
        f"{k}_compiled"].get("step_s", ours[f"{k}_compiled"].get("s"))
        for k in keys if f"{k}_compiled" in ours}


def _one_round(args: argparse.Namespace, threads: int, device: torch.device) -> dict[str, Any]:
    """Every measurement once: peaks, each dtype (ours and the baselines), the engine."""
    cfg = ModelConfig.from_name(args.preset)
    out: dict[str, Any] = {"peaks": measure_peaks(cfg, args.dtypes, args.quick, device)}
    for name in args.dtypes:
        model = _model(args.preset, name, args.device)
        out[name] = {"ours": _ours_raw(model, args), "baselines": _baselines(model, args, threads)}
        del model
    engine_dtype = "float32" if device.type == "cpu" else "bfloat16"
    prompt_and_output = (8, 8) if args.quick else (64, 64)
    out["batching"] = batching.measure(_model(args.preset, engine_dtype, args.device),
                                       args.concurrent, *prompt_and_output)
    # Peaks again at the round's end: a peak caught in a busy spell would inflate fractions.
    again = measure_peaks(cfg, args.dtypes, args.quick, device)
    out["peaks"] = best_of_rounds(out["peaks"], again, larger=True)
    return out


def _summary(results: dict, primary: str) -> dict[str, Any]:
    """The issue's headline fields, from the primary dtype (fp32 on CPU, bf16 on GPU)."""
    r = results["dtypes"][primary]
    n = results["prefill_lengths"][0]
    return {
        "primary_dtype": primary,
        "decode_bw_fraction_b1": r["ours"]["decode_b1"]["bw_fraction"],
        "decode_bw_fraction_b1_interleaved": r["ours"]["interleaved_b1_triad"]["bw_fraction"],
        "decode_read_fraction_b1_interleaved": r["ours"]["interleaved_b1_triad"]["read_fraction"],
        "decode_bw_fraction_b8": r["ours"]["decode_b8"]["bw_fraction"],
        "prefill_flops_fraction_512": r["ours"][f"prefill_{n}"]["flops_fraction"],
        "prefill_gemm_ceiling_fraction_512": r["ours"][f"prefill_{n}"].get("gemm_ceiling_fraction"),
        "prefill_flops_fraction_512_interleaved":
            r["ours"][f"interleaved_prefill_{n}_gemm"]["flops_fraction"],
        **{k: v for k, v in r["ratios"].items()},
        "continuous_batching_speedup": results["batching"]["continuous_batching_speedup"],
        "continuous_batching_flop_bound_speedup": results["batching"].get("flop_bound_speedup"),
        "continuous_batching_decode_speedup": results["batching"].get("decode_batching_speedup"),
    }


def _fmt(v: Any, spec: str = ".2f") -> str:
    return "n/a" if v is None else format(v, spec)


def _print_table(results: dict) -> None:
    peaks = results["peaks"]
    print(f"threads {results['threads']}, device {results['device']}, preset {results['preset']}, "
          f"context {results['context']}, native kernel: {results['native_kernel']}")
    print(f"triad {peaks['triad_bytes_per_s'] / 1e9:.1f} GB/s; matmul at model shapes: "
          + ", ".join(f"{k.rsplit('_', 1)[-1]} {v / 1e9:.0f} GFLOP/s"
                      for k, v in peaks.items() if k.startswith("matmul_model")))
    n = results["prefill_lengths"][0]
    head = ("dtype", "dec b1 tok/s", "b1 %BW (interleaved triad, read)", "dec b8 tok/s", "b8 %BW",
            f"pf{n} %peak", "vs HF dec", f"vs HF pf{n}", "vs llama.cpp dec (interleaved)",
            "kernel x")
    print(" | ".join(head))
    for name, r in results["dtypes"].items():
        o, q = r["ours"], r["ratios"]
        print(" | ".join([
            name,
            f"{o['decode_b1']['tok_per_s']:.1f}",
            f"{100 * o['decode_b1']['bw_fraction']:.0f}% "
            f"({100 * o['interleaved_b1_triad']['bw_fraction']:.0f}%, "
            f"{100 * o['interleaved_b1_triad']['read_fraction']:.0f}%)",
            f"{o['decode_b8']['tok_per_s']:.1f}",
            f"{100 * o['decode_b8']['bw_fraction']:.0f}%",
            f"{100 * o[f'prefill_{n}']['flops_fraction']:.0f}%",
            _fmt(q["speedup_vs_transformers_decode_b1"]),
            _fmt(q["speedup_vs_transformers_prefill_512"]),
            f"{_fmt(q['speedup_vs_llamacpp_decode_b1'])} "
            f"({_fmt(q['speedup_vs_llamacpp_decode_b1_interleaved'])})",
            _fmt(q["native_kernel_speedup_decode_b1"]),
        ]))
        pf = o[f"prefill_{n}"]
        if "gemm_ceiling_fraction" in pf:
            ceiling = 100 * pf["gemm_ceiling_fraction"]
            paired = 100 * o[f"interleaved_prefill_{n}_gemm"]["flops_fraction"]
            print(f"  prefill {n}: {100 * pf['flops_fraction']:.0f}% of the matmul peak "
                  f"({paired:.0f}% of the gate/up GEMM timed in alternation); its own GEMM "
                  f"shapes, each alone, allow at most {ceiling:.0f}%")
        if "compile_first_calls_s" in o:
            print(f"  torch.compile: decode b1 {q['compile_speedup_decode_b1']:.3f}x, b8 "
                  f"{q['compile_speedup_decode_b8']:.3f}x, prefill {n} "
                  f"{q[f'compile_speedup_prefill_{n}']:.3f}x as-is time over compiled (>1: "
                  f"faster compiled); first calls {o['compile_first_calls_s']:.1f} s")
        for key in ("transformers", "llamacpp"):
            if isinstance(r["baselines"].get(key), str):
                print(f"  {key}: {r['baselines'][key]}")
    b = results["batching"]
    bound = (f" (the matmul peak's bound: {b['flop_bound_speedup']:.2f}x; the "
             f"{results['concurrent']} requests ran at {b['concurrent_peak_fraction']:.0%} of it)"
             if "flop_bound_speedup" in b else "")
    print(f"engine: {b['continuous_batching_speedup']:.2f}x output tok/s at "
          f"{results['concurrent']} concurrent vs 1{bound}")
    if "decode_batching_speedup" in b:
        print(f"  its decode steps alone: {b['decode_batching_speedup']:.2f}x tok/s; the "
              f"{results['concurrent']} prompts' prefill took "
              f"{b['prefill_time_fraction_concurrent']:.0%} of the concurrent run")


def _bf16_linears() -> str:
    """Which packed GEMM bf16 prefill linears take here: oneDNN's bf16, or the fp32 one on
    bf16 widened (a CPU without bf16 instructions, or without AVX-512), or none."""
    plan = packed_linear.gemm_plan(torch.bfloat16)
    if plan is None:
        return "none"
    return f"{plan[0]}, widened to fp32" if plan[1] else plan[0]


def _bf16_attention(head_dim: int) -> str:
    """Which path bf16 prefill attention takes here."""
    if not prefill_attention.takes_bf16(head_dim):
        return "sdpa"
    return "native, AMX tiles" if amx.AMX_TILES else "native"


def main() -> None:
    args = _args()
    threads = _threads(args.threads)
    device = torch.device(args.device)
    kept = keep_freed_memory() if device.type == "cpu" else False  # as the engine runs
    kernel = build.status()
    results: dict[str, Any] = {
        "preset": args.preset, "device": args.device, "cpu": cpu_model_name(), "threads": threads,
        "context": args.context, "prefill_lengths": args.prefill, "quick": args.quick,
        "concurrent": args.concurrent, "rounds": args.rounds,
        "native_kernel": kernel.reason if kernel.loaded else f"unavailable ({kernel.reason})",
        "packed_prefill_linears": packed_linear.mode(),
        "packed_prefill_gemm": packed_linear.backend(),
        "packed_prefill_gemm_bfloat16": _bf16_linears(),
        "bf16_prefill_attention": _bf16_attention(ModelConfig.from_name(args.preset).head_dim),
        "malloc_keeps_freed_memory": kept,
        "llamacpp_version": llama_cpp_module()[1],
        "torch": torch.__version__,
    }
    merged: dict[str, Any] = {}
    for _ in range(args.rounds):  # rounds interleave the systems: each gets the quiet spells
        r = _one_round(args, threads, device)
        merged = r if not merged else {
            "peaks": best_of_rounds(merged["peaks"], r["peaks"], larger=True),
            "batching": best_of_rounds(merged["batching"], r["batching"], larger=True),
            **{n: best_of_rounds(merged[n], r[n]) for n in args.dtypes},
        }
    results["peaks"] = merged["peaks"]
    cfg = ModelConfig.from_name(args.preset)
    results["batching"] = batching.figures(merged["batching"], results["peaks"], cfg,
                                           args.concurrent)
    results["dtypes"] = {}
    for name in args.dtypes:
        ours = derive_fractions(merged[name]["ours"], results["peaks"], name, cfg)
        base = merged[name]["baselines"]
        results["dtypes"][name] = {
            "ours": ours, "baselines": base, "ratios": _ratios(ours, base, args.prefill[0])
        }
    results["gemm_forms"] = gemm_choice.chosen()  # the form each prefill linear took here
    primary = "float32" if "float32" in args.dtypes else args.dtypes[0]
    results.update(_summary(results, primary))
    _print_table(results)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
