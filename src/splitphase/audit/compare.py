"""`splitphase compare`: the same probe on several targets, answered phase by phase."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from splitphase.audit.report import fmt
from splitphase.audit.steps import Profile


@dataclass(frozen=True)
class PhaseSpeeds:
    """What one target delivers per phase, from its profile alone (no geometry needed)."""

    spec: str
    ttft_p50_s: float
    itl_p50_s: float
    prefill_tokens_per_s: float  # best point: prompt tokens over the union of prefill intervals
    decode_tokens_per_s: float  # best point: streams decoding at once over the step time
    decode_tokens_per_s_single: float  # one stream: 1 / p50 step at concurrency 1
    kv_cache_dtype: str | None = None  # as the target states it; decode reads K/V at its width
    weights: str | None = None  # its weights' format as it states it (None: not stated)


def kv_cache_of(described: dict[str, Any]) -> str | None:
    """A target's K/V cache dtype from its description (transformers': the model's dtype)."""
    if described.get("kind") == "hf":
        return described.get("dtype")
    return described.get("kv_cache_dtype")


def weights_of(described: dict[str, Any]) -> str | None:
    """A target's weight format: the quantization an openai: server's model states, else the
    dtype it states it computes in (ours), or the dtype an in-process model runs in."""
    if described.get("kind") in ("builtin", "hf"):
        return described.get("dtype")
    return described.get("quantization") or described.get("model_dtype")


def phase_speeds(spec: str, prof: Profile, kv_cache_dtype: str | None = None,
                 weights: str | None = None) -> PhaseSpeeds:
    """Per-phase speeds of one target's profile."""
    single = [p for p in prof.points if p.concurrency == 1] or list(prof.points)
    return PhaseSpeeds(
        spec=spec,
        ttft_p50_s=prof.ttft.p50_s,
        itl_p50_s=prof.itl.p50_s,
        prefill_tokens_per_s=max(p.n * p.prompt_tokens / p.prefill_busy_s for p in prof.points),
        decode_tokens_per_s=max(p.decode_batch / p.decode_step_s for p in prof.points),
        decode_tokens_per_s_single=max(1 / p.decode_step_s for p in single),
        kv_cache_dtype=kv_cache_dtype,
        weights=weights,
    )


def _ratio_words(phase: str, ratio: float) -> str:
    # Two decimals as in the table: one rounded 0.94x to "0.9x" and 1.05x to "1.0x faster".
    if ratio >= 1.05:
        return f"{phase} {ratio:.2f}x faster"
    if ratio <= 0.95:
        return f"{phase} {ratio:.2f}x (slower)"
    return f"{phase} about the same ({ratio:.2f}x)"


def verdicts(speeds: list[PhaseSpeeds]) -> list[str]:
    """One line per target after the first: 'prefill 3.1x faster, decode 0.8x (slower)'."""
    base = speeds[0]
    out = []
    for s in speeds[1:]:
        pre = s.prefill_tokens_per_s / base.prefill_tokens_per_s
        dec = s.decode_tokens_per_s / base.decode_tokens_per_s
        caches = {s.kv_cache_dtype, base.kv_cache_dtype}
        differ = None not in caches and len(caches) > 1  # decode then reads different bytes
        notes = [f"K/V cache {s.kv_cache_dtype} vs {base.kv_cache_dtype}"] if differ else []
        formats = {s.weights, base.weights}
        if None not in formats and len(formats) > 1:  # so do weights of another format
            notes.append(f"weights {s.weights} vs {base.weights}")
        out.append(f"{s.spec} vs {base.spec}: {_ratio_words('prefill', pre)}, "
                   f"{_ratio_words('decode', dec)}"
                   + (f" ({'; '.join(notes)})" if notes else ""))
    return out


def table_rows(speeds: list[PhaseSpeeds]) -> list[list[str]]:
    """Rows of the comparison table, ratios against the first target."""
    base = speeds[0]
    return [
        [s.spec, s.kv_cache_dtype or "not stated", s.weights or "not stated",
         f"{s.ttft_p50_s * 1e3:.1f} ms",
         fmt.rate(s.prefill_tokens_per_s),
         f"{s.prefill_tokens_per_s / base.prefill_tokens_per_s:.2f}x",
         f"{s.itl_p50_s * 1e3:.2f} ms", fmt.rate(s.decode_tokens_per_s),
         f"{s.decode_tokens_per_s / base.decode_tokens_per_s:.2f}x"]
        for s in speeds
    ]


TABLE_HEADER = ["target", "K/V cache", "weights", "TTFT p50", "prefill tok/s", "prefill vs first",
                "ITL p50", "decode tok/s", "decode vs first"]


def compare_doc(speeds: list[PhaseSpeeds]) -> dict[str, Any]:
    """compare.json's document."""
    return {
        "targets": [s.__dict__ for s in speeds],
        "verdicts": verdicts(speeds),
        "baseline": speeds[0].spec,
    }


def compare_plot(speeds: list[PhaseSpeeds]) -> str:
    """Grouped bars: each target's prefill and decode speed relative to the first (base64 PNG)."""
    from splitphase.audit.report.plots import BLUE, ORANGE, pyplot, to_png

    plt = pyplot()
    base = speeds[0]
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    xs = range(len(speeds))
    ax.bar([x - 0.2 for x in xs], [s.prefill_tokens_per_s / base.prefill_tokens_per_s
                                   for s in speeds], width=0.4, color=BLUE, label="prefill")
    ax.bar([x + 0.2 for x in xs], [s.decode_tokens_per_s / base.decode_tokens_per_s
                                   for s in speeds], width=0.4, color=ORANGE, label="decode")
    ax.axhline(1.0, color="#6b7280", ls="--", lw=1)
    ax.set_xticks(list(xs), [s.spec for s in speeds], rotation=15, ha="right")
    ax.set_ylabel(f"speed relative to {base.spec}")
    ax.set_title("Phase by phase")
    ax.legend(frameon=False)
    return to_png(fig)
