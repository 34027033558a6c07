"""Pretraining loop: AdamW, warmup + cosine schedule, clipping, periodic validation, resumable.

CPU is the target here (bf16 autocast roughly doubles matmul throughput on AVX-512 bf16
cores); CUDA runs unchanged with `device="cuda"`. State is written to `out_dir/state.pt`
at every evaluation so `resume=True` continues where a run stopped.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from splitphase.model.checkpoint import build_model, save_checkpoint
from splitphase.model.config import ModelConfig
from splitphase.training.evaluate import evaluate

STATE_FILE = "state.pt"
LOG_FILE = "train_log.jsonl"


@dataclass(frozen=True)
class TrainConfig:
    """One training run; serialised into the checkpoint's config.json."""

    preset: str = "small"
    arch: str = "baseline"
    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_interval: int = 200
    eval_max_tokens: int = 65536
    seed: int = 0
    device: str = "auto"
    amp: str = "bf16"  # bf16 | none
    save_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "eval_interval"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.amp not in ("bf16", "none"):
            raise ValueError(f"amp must be 'bf16' or 'none', got {self.amp!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")


def pick_device(name: str) -> torch.device:
    """'auto' picks CUDA when present, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio * lr."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def sample_batch(
    tokens: np.ndarray, batch_size: int, seq_len: int, gen: np.random.Generator
) -> torch.Tensor:
    """Random windows (B, T+1) from a token array."""
    starts = gen.integers(0, len(tokens) - seq_len - 1, size=batch_size)
    return torch.from_numpy(
        np.stack([tokens[s : s + seq_len + 1] for s in starts]).astype(np.int64)
    )


def _optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    # No weight decay on norms (1-D weights), as in nanoGPT.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))


class Trainer:
    """Trains one model on token arrays and writes checkpoints and a JSONL log."""

    def __init__(
        self,
        cfg: TrainConfig,
        train_tokens: np.ndarray,
        val_tokens: np.ndarray,
        val_boundaries: np.ndarray | None,
        out_dir: str | Path,
        model_cfg: ModelConfig | None = None,
    ) -> None:
        self.cfg, self.out = cfg, Path(out_dir)
        self.train_tokens, self.val_tokens, self.val_boundaries = (
            train_tokens,
            val_tokens,
            val_boundaries,
        )
        self.device = pick_device(cfg.device)
        torch.manual_seed(cfg.seed)
        base = model_cfg or ModelConfig.from_name(cfg.preset)
        self.model_cfg = base.with_(arch=cfg.arch, dtype="float32")
        self.model = build_model(self.model_cfg).to(self.device)
        self.opt = _optimizer(self.model, cfg)
        self.rng = np.random.default_rng(cfg.seed)
        self.step = 0
        self.best_val = float("inf")
        self.wall_s = 0.0  # training time of all segments of this run, saved across resumes

    def _save_state(self) -> None:
        state = {
            "model": self.model.state_dict(),
            "opt": self.opt.state_dict(),
            "step": self.step,
            "rng": self.rng.bit_generator.state,
            "best_val": self.best_val,
            "wall_s": self.wall_s,
        }
        torch.save(state, self.out / STATE_FILE)

    def resume(self) -> bool:
        """Load out_dir/state.pt if present; True when a run was resumed."""
        path = self.out / STATE_FILE
        if not path.exists():
            return False
        state = torch.load(path, map_location=self.device, weights_only=False)
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        self.step, self.best_val = state["step"], state["best_val"]
        self.wall_s = float(state.get("wall_s", 0.0))
        self.rng.bit_generator.state = state["rng"]
        return True

    def _log(self, record: dict[str, Any]) -> None:
        with open(self.out / LOG_FILE, "a") as f:
            f.write(json.dumps(record) + "\n")

    def _train_step(self) -> float:
        for group in self.opt.param_groups:
            group["lr"] = lr_at(self.step, self.cfg)
        batch = sample_batch(self.train_tokens, self.cfg.batch_size, self.cfg.seq_len, self.rng)
        batch = batch.to(self.device)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.amp == "bf16"):
            logits = self.model(batch[:, :-1])  # (B, T, V)
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()

    def _evaluate(self) -> dict[str, Any]:
        res = evaluate(
            self.model,
            self.val_tokens,
            self.val_boundaries,
            self.cfg.seq_len,
            max_tokens=self.cfg.eval_max_tokens,
        )
        return {
            "val_loss": res.loss,
            "val_tokens": res.tokens,
            "continuation_loss": res.continuation_loss,
        }

    def train(self, progress: bool = True, until: int | None = None) -> dict[str, Any]:
        """Run to cfg.steps (or stop early at step `until`); returns the final metrics."""
        self.out.mkdir(parents=True, exist_ok=True)
        tokens_per_step = self.cfg.batch_size * self.cfg.seq_len
        t_start = time.perf_counter()
        start_step, prior_wall_s = self.step, self.wall_s
        bar = tqdm(total=self.cfg.steps, initial=self.step, disable=not progress, unit="step")
        metrics: dict[str, Any] = {}
        last = self.cfg.steps if until is None else min(until, self.cfg.steps)
        while self.step < last:
            loss = self._train_step()
            self.step += 1
            elapsed = time.perf_counter() - t_start
            tok_per_s = (self.step - start_step) * tokens_per_step / max(elapsed, 1e-9)
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_per_s:,.0f}")
            record: dict[str, Any] = {
                "step": self.step,
                "loss": loss,
                "lr": lr_at(self.step - 1, self.cfg),
                "tokens_per_s": tok_per_s,
            }
            if self.step % self.cfg.eval_interval == 0 or self.step == last:
                metrics = self._evaluate()
                record.update(metrics)
                self.best_val = min(self.best_val, metrics["val_loss"])
                self.wall_s = prior_wall_s + time.perf_counter() - t_start
                self._save_state()
            self._log(record)
        bar.close()
        self.wall_s = prior_wall_s + time.perf_counter() - t_start
        metrics = metrics or self._evaluate()
        return {
            **metrics,
            "steps": self.step,
            "train_tokens": self.step * tokens_per_step,
            "wall_s": self.wall_s,
        }

    def save(self, summary: dict[str, Any]) -> Path:
        """Write the final checkpoint (weights in cfg.save_dtype) with the run's record."""
        extra = {"training": {"config": asdict(self.cfg), **summary}}
        return save_checkpoint(
            self.model, self.out / "model", dtype=self.cfg.save_dtype, extra=extra
        )
