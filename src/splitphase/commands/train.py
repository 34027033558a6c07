"""`splitphase train` and `splitphase eval`: pretraining and held-out validation loss."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from splitphase.data.corpus import default_data_dir
from splitphase.data.shards import load_split, load_val_boundaries
from splitphase.errors import UserError
from splitphase.model.checkpoint import load_model
from splitphase.training.evaluate import HORIZON, MAX_PROMPTS, evaluate
from splitphase.training.trainer import TrainConfig, Trainer


def _load(data_dir: str | None, split: str) -> np.ndarray:
    root = Path(data_dir) if data_dir else default_data_dir()
    try:
        return load_split(root, split)
    except FileNotFoundError as exc:
        raise UserError(
            f"no prepared {split} split in {root}: run `splitphase data prepare` (or `make data`)"
        ) from exc


def _boundaries(data_dir: str | None) -> np.ndarray | None:
    root = Path(data_dir) if data_dir else default_data_dir()
    try:
        return load_val_boundaries(root)
    except FileNotFoundError:
        return None


def train(cfg: TrainConfig, out_dir: str, data_dir: str | None, resume: bool) -> None:
    """Train, print the final metrics and write out_dir/model (a loadable checkpoint)."""
    train_tokens, val_tokens = _load(data_dir, "train"), _load(data_dir, "val")
    trainer = Trainer(cfg, train_tokens, val_tokens, _boundaries(data_dir), out_dir)
    if resume and trainer.resume():
        print(f"resumed at step {trainer.step}")
    summary = trainer.train()
    (Path(out_dir) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    path = trainer.save(summary)
    print(json.dumps(summary))
    print(f"checkpoint: {path}")


def eval_model(
    model_name: str, max_tokens: int | None, data_dir: str | None, as_json: bool, seq_len: int = 256
) -> None:
    """Validation loss and continuation loss of a model on the held-out split."""
    if max_tokens is not None and max_tokens <= seq_len:
        raise UserError(f"--max-tokens must be > {seq_len} (one window), got {max_tokens}")
    model = load_model(model_name)
    # --max-tokens bounds both metrics: the continuation loss alone would score 16,384 tokens
    # (512 prompts, each read with 192 tokens of context).
    prompts = MAX_PROMPTS if max_tokens is None else max(1, min(MAX_PROMPTS, max_tokens // HORIZON))
    res = evaluate(model, _load(data_dir, "val"), _boundaries(data_dir), seq_len, max_tokens,
                   max_prompts=prompts)
    doc = {
        "model": model_name,
        "tokens": res.tokens,
        "loss": round(res.loss, 4),
        "continuation_loss": None
        if res.continuation_loss is None
        else round(res.continuation_loss, 4),
    }
    if as_json:
        print(json.dumps(doc))
    else:
        print(
            f"{model_name}: validation loss {doc['loss']} nats/token over {res.tokens} tokens; "
            f"continuation loss {doc['continuation_loss']}"
        )


def train_config_from_args(**kwargs: object) -> TrainConfig:
    """A TrainConfig from CLI values, ignoring the ones left unset."""
    try:
        return replace(TrainConfig(), **{k: v for k, v in kwargs.items() if v is not None})  # type: ignore[arg-type]
    except ValueError as exc:
        raise UserError(str(exc)) from exc
