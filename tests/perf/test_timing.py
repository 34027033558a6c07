"""Interleaved timing: alternating bursts, the best of each, and a repeatable decode step."""

from __future__ import annotations

import time

import torch

from splitphase.model.config import ModelConfig
from splitphase.model.transformer import Transformer
from splitphase.perf.timing import decode_step_fn, interleaved_best_s


def test_interleaved_bursts_alternate_and_keep_each_best() -> None:
    calls: list[str] = []

    def system(name: str, seconds: float):
        def run() -> None:
            calls.append(name)
            time.sleep(seconds)

        return run

    best = interleaved_best_s({"a": system("a", 0.002), "b": system("b", 0.006)}, 3, burst=2)
    assert calls == ["a", "b"] + (["a"] * 2 + ["b"] * 2) * 3  # one untimed call each first
    assert 0.002 <= best["a"] < best["b"] and best["b"] >= 0.006


def test_the_decode_step_stays_at_its_context() -> None:
    # The cache has one spare position: a step that left the context one longer would
    # overflow it on the next call.
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name("tiny")).eval()
    step = decode_step_fn(model, 2, 9)
    for _ in range(5):
        step()
