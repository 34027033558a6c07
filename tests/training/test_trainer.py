import json

import numpy as np
import pytest
import torch

from splitphase.model.checkpoint import load_model
from splitphase.training.evaluate import HORIZON, continuation_loss, evaluate
from splitphase.training.trainer import TrainConfig, Trainer, lr_at


def _stream(n: int, seed: int) -> np.ndarray:
    # A learnable stream: short "words" of a fixed alphabet that follow each other in order.
    rng = np.random.default_rng(seed)
    words = [list(rng.integers(1, 500, size=4)) for _ in range(20)]
    out: list[int] = []
    while len(out) < n:
        out += words[len(out) % 20]
    return np.array(out[:n], dtype=np.uint16)


CFG = TrainConfig(
    preset="tiny",
    steps=40,
    batch_size=8,
    seq_len=32,
    lr=3e-3,
    warmup_steps=5,
    eval_interval=20,
    eval_max_tokens=2048,
    amp="none",
)


def test_training_reduces_validation_loss(tmp_path):
    train, val = _stream(20000, 0), _stream(4000, 0)
    trainer = Trainer(CFG, train, val, None, tmp_path)
    before = evaluate(trainer.model, val, None, 32, max_tokens=2048).loss
    summary = trainer.train(progress=False)
    assert summary["val_loss"] < before - 1.0
    log = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == 40 and "val_loss" in log[19] and log[-1]["tokens_per_s"] > 0
    path = trainer.save(summary)
    model = load_model(str(path))
    assert abs(evaluate(model, val, None, 32, max_tokens=2048).loss - summary["val_loss"]) < 0.05


def test_resume_continues_the_same_run(tmp_path):
    train, val = _stream(20000, 1), _stream(4000, 1)
    straight = Trainer(CFG, train, val, None, tmp_path / "a")
    straight.train(progress=False)
    first = Trainer(CFG, train, val, None, tmp_path / "b")
    first.train(progress=False, until=20)  # as if the run had been stopped at step 20
    second = Trainer(CFG, train, val, None, tmp_path / "b")
    assert second.resume() and second.step == 20
    first_segment_s = second.wall_s
    summary = second.train(progress=False)
    assert summary["wall_s"] > first_segment_s > 0  # both segments are counted
    for p, q in zip(straight.model.parameters(), second.model.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def test_lr_schedule_warms_up_and_decays():
    cfg = TrainConfig(steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(100, cfg) == pytest.approx(0.1)
    assert lr_at(50, cfg) > lr_at(80, cfg)


def test_invalid_train_config():
    with pytest.raises(ValueError, match="steps"):
        TrainConfig(steps=0)


def test_continuation_loss_scores_tokens_after_boundaries(tmp_path):
    trainer = Trainer(CFG, _stream(5000, 2), _stream(3000, 2), None, tmp_path)
    tokens = _stream(3000, 2)
    loss, n = continuation_loss(
        trainer.model, tokens, np.array([200, 400, 900]), context=64, horizon=8
    )
    assert n == 3 * 8 and loss > 0


def test_evaluate_scores_at_most_max_prompts_continuations(tmp_path):
    trainer = Trainer(CFG, _stream(5000, 2), _stream(3000, 2), None, tmp_path)
    tokens = _stream(3000, 2)
    boundaries = np.arange(200, 2900, 100)  # 27 prompts
    res = evaluate(trainer.model, tokens, boundaries, 32, max_tokens=256, max_prompts=3)
    assert res.tokens == 256 and res.continuation_tokens == 3 * HORIZON
    default = evaluate(trainer.model, tokens, boundaries, 32, max_tokens=256)
    assert default.continuation_tokens > 3 * HORIZON
