"""`splitphase generate` and `splitphase demo`: text from a model, timed per phase."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import torch

from splitphase.errors import UserError
from splitphase.model.checkpoint import load_model, resolve_model_dir
from splitphase.model.tokenizer import Tokenizer
from splitphase.model.transformer import Transformer, sample_token

DEFAULT_MODEL = "small"
DEMO_PROMPTS = ("In the beginning God created", "ROMEO. But soft, what light")


@dataclass(frozen=True)
class Generation:
    """One completion with the time spent in each phase."""

    prompt: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    prefill_s: float
    decode_s: float

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        steps = len(self.token_ids) - 1  # the first token comes out of prefill
        return steps / self.decode_s if self.decode_s > 0 and steps > 0 else 0.0


def load_tokenizer(name_or_path: str) -> Tokenizer:
    """The model directory's own tokenizer.json, else the shipped one."""
    path = resolve_model_dir(name_or_path) / "tokenizer.json"
    return Tokenizer.from_file(path) if path.exists() else Tokenizer.default()


def _check_args(max_tokens: int, temperature: float) -> None:
    if max_tokens < 1:
        raise UserError(f"--max-tokens must be >= 1, got {max_tokens}")
    if not temperature >= 0:
        raise UserError(f"--temperature must be >= 0, got {temperature}")


@torch.inference_mode()
def timed_generate(
    model: Transformer,
    tok: Tokenizer,
    prompt: str,
    max_tokens: int,
    temperature: float,
    seed: int | None,
) -> Generation:
    """Prefill once, then decode token by token, timing each phase separately."""
    _check_args(max_tokens, temperature)
    ids = tok.encode(prompt, add_bos=True)
    if len(ids) + max_tokens > model.cfg.max_seq_len:
        raise UserError(
            f"prompt ({len(ids)} tokens) + max tokens ({max_tokens}) exceeds the model's context "
            f"of {model.cfg.max_seq_len} tokens"
        )
    gen = torch.Generator().manual_seed(0 if seed is None else seed)
    cache = model.new_cache(1, len(ids) + max_tokens)
    t0 = time.perf_counter()
    logits, _ = model.prefill(torch.tensor([ids], device=model.device), cache)
    out = [sample_token(logits[0], temperature, 0, gen)]
    t1 = time.perf_counter()
    while len(out) < max_tokens and out[-1] != tok.eos_token_id:
        logits = model.decode_step(torch.tensor([out[-1]], device=model.device), cache)
        out.append(sample_token(logits[0], temperature, 0, gen))
    t2 = time.perf_counter()
    return Generation(prompt, tok.decode(out), out, len(ids), t1 - t0, t2 - t1)


def generate(
    model_name: str,
    prompts: list[str],
    max_tokens: int,
    temperature: float,
    seed: int | None,
    as_json: bool,
) -> None:
    """Print completions and per-phase timing (or one JSON object)."""
    _check_args(max_tokens, temperature)
    model, tok = load_model(model_name), load_tokenizer(model_name)
    gens = [timed_generate(model, tok, p, max_tokens, temperature, seed) for p in prompts]
    if as_json:
        print(json.dumps({"outputs": [asdict(g) for g in gens]}))
        return
    for g in gens:
        print(f"{g.prompt}\033[1m{g.text}\033[0m")
        print(
            f"  prefill: {g.prompt_tokens} tokens in {g.prefill_s * 1e3:.1f} ms "
            f"({g.prefill_tokens_per_s:,.0f} tok/s) | decode: {len(g.token_ids)} tokens in "
            f"{g.decode_s * 1e3:.1f} ms ({g.decode_tokens_per_s:,.1f} tok/s)\n"
        )


def demo() -> None:
    """Until the audit lands: generate from the embedded model and show per-phase speed."""
    print(f"splitphase demo: embedded model {DEFAULT_MODEL!r}, greedy, CPU\n")
    generate(
        DEFAULT_MODEL, list(DEMO_PROMPTS), max_tokens=48, temperature=0.0, seed=0, as_json=False
    )
