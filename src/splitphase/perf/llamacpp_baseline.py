"""The same weights through llama.cpp (`llama-cpp-python`), exported to GGUF by us.

Decode is one `eval` of a single token after a `context`-token prompt (greedy sampling is not
timed, as ours is not); prefill is one `eval` of the prompt into an empty context. Best of
several runs, as ours. Given our own decode step, the two steps are also timed in
alternating bursts (`interleaved_best_s`): on a host whose memory speed moves between
minutes, the only ratio that compares the code rather than the minute.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from splitphase.model.gguf_export import export_gguf
from splitphase.model.transformer import Transformer
from splitphase.perf.timing import interleaved_best_s


def llama_cpp_module() -> tuple[Any | None, str]:
    """The `llama_cpp` module and its version, or None and why it is missing."""
    try:
        import llama_cpp
    except ImportError as exc:
        return None, f"llama-cpp-python is not installed ({exc}); `make bench` installs it"
    return llama_cpp, str(getattr(llama_cpp, "__version__", "?"))


def time_llamacpp(
    model: Transformer,
    workdir: Path,
    threads: int,
    context: int,
    decode_tokens: int,
    prefill_len: int,
    repeats: int,
    ours_decode: Callable[[], object] | None = None,
) -> dict[str, float] | str:
    """llama.cpp's decode step seconds (batch 1) and prefill seconds, or why they are missing;
    with `ours_decode` (one of our batch-1 steps at `context`), both steps' best seconds in
    alternating bursts too (`*_interleaved`)."""
    llama_cpp, why = llama_cpp_module()
    if llama_cpp is None:
        return why
    llm = open_llamacpp(
        llama_cpp, model, workdir, threads,
        n_ctx=max(context + decode_tokens + 8, prefill_len + 8), n_batch=max(prefill_len, context),
    )
    prompt = llamacpp_prompt(model.cfg.vocab_size, max(context, prefill_len))
    prefills = []
    for _ in range(repeats):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt[:prefill_len])
        prefills.append(time.perf_counter() - t0)
    llm.reset()
    llm.eval(prompt[:context])
    steps = []
    for i in range(decode_tokens + 2):
        t0 = time.perf_counter()
        llm.eval([prompt[i]])
        steps.append(time.perf_counter() - t0)
    out = {"decode_step_s_b1": min(steps[2:]), "prefill_s": min(prefills)}
    if ours_decode is not None:
        llm.reset()
        llm.eval(prompt[:context])
        both = interleaved_best_s(
            {"ours": ours_decode, "llamacpp": llamacpp_decode_step(llm, prompt)}, decode_tokens // 2
        )
        out["decode_step_s_b1_interleaved"] = both["llamacpp"]
        out["ours_decode_step_s_b1_interleaved"] = both["ours"]
    return out


def open_llamacpp(
    llama_cpp: Any, model: Transformer, workdir: Path, threads: int, n_ctx: int, n_batch: int
) -> Any:
    """`model` exported to GGUF in `workdir` and loaded by llama.cpp with `threads` threads."""
    path = export_gguf(model, None, workdir / f"{model.cfg.name}-{model.cfg.dtype}.gguf")
    return llama_cpp.Llama(
        model_path=str(path), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch,
        n_threads=threads, n_threads_batch=threads, verbose=False,
    )


def llamacpp_prompt(vocab_size: int, n: int) -> list[int]:
    """The token ids llama.cpp is timed on: spread over the vocabulary, past the first few."""
    return [(i * 7919 + 13) % (vocab_size - 5) + 5 for i in range(n)]


def llamacpp_decode_step(llm: Any, prompt: list[int]) -> Callable[[], None]:
    """One llama.cpp decode step after whatever `llm` holds, repeatable at that context."""

    def step() -> None:
        llm.eval([prompt[5]])
        llm.n_tokens -= 1  # the next eval overwrites this position: the context stays

    return step
