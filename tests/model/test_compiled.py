"""The optional torch.compile of prefill and decode: same outputs as eager, off by default."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
from torch._dynamo.utils import counters

from splitphase.kernels import build, decode_stack, packed_linear
from splitphase.model import compiled
from splitphase.model.config import ModelConfig
from splitphase.model.transformer import Transformer


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig.from_name("tiny")).eval()


@pytest.fixture
def counting(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """How many passes took the compiled pieces."""
    calls: list[int] = []
    real = compiled.run_layers

    def spy(*args: object) -> torch.Tensor:
        calls.append(1)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(compiled, "run_layers", spy)
    yield calls


def _generate(model: Transformer, prompt: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Prefill logits, then the logits of `steps` greedy decode steps: (B, V) each."""
    cache = model.new_cache(prompt.shape[0], prompt.shape[1] + steps)
    logits, cache = model.prefill(prompt, cache)
    out = [logits]
    for _ in range(steps):
        logits = model.decode_step(logits.argmax(-1), cache)
        out.append(logits)
    return out


@pytest.mark.parametrize("native", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_compiled_passes_match_eager(inductor, model, counting, native: bool) -> None:
    prompts = [torch.randint(0, model.cfg.vocab_size, (b, t)) for b, t in ((1, 9), (2, 5))]
    want = [_generate(model, p, 3) for p in prompts]
    assert counting == []  # off by default
    # The one-call decode stack keeps decode where it applies: off, so the pieces run.
    with compiled.switched(True), compiled.native_in_graph(native), decode_stack.switched(False):
        got = [_generate(model, p, 3) for p in prompts]
    assert len(counting) == 2 * 4  # every prefill and decode pass took the pieces
    for w_run, g_run in zip(want, got, strict=True):
        for w, g in zip(w_run, g_run, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_one_phase_only(inductor, model, counting) -> None:
    prompt = torch.randint(0, model.cfg.vocab_size, (1, 6))
    with decode_stack.switched(False):
        with compiled.switched(True, ["prefill"]):
            _generate(model, prompt, 2)
        assert len(counting) == 1
        with compiled.switched(True, ["decode"]):
            _generate(model, prompt, 2)
        assert len(counting) == 1 + 2


@pytest.mark.skipif(not build.available(), reason="native kernels unavailable")
def test_decode_stack_keeps_decode(inductor, model, counting) -> None:
    prompt = torch.randint(0, model.cfg.vocab_size, (1, 6))
    with compiled.switched(True):
        _generate(model, prompt, 2)
    assert len(counting) == 1  # the prefill; both decode steps took the one native call


def test_off_leaves_model_untouched(model, counting) -> None:
    prompt = torch.randint(0, model.cfg.vocab_size, (1, 6))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    first = _generate(model, prompt, 2)
    assert counting == [] and compiled.enabled_phases() == []
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(a, b) for a, b in zip(first, _generate(model, prompt, 2), strict=True))


def test_training_is_not_compiled(model, counting) -> None:
    with compiled.switched(True):
        model(torch.randint(0, model.cfg.vocab_size, (1, 6)))  # grad on: teacher forcing
    assert counting == []


def test_moe_stays_eager(counting) -> None:
    moe = Transformer(ModelConfig.from_name("tiny-moe")).eval()
    with compiled.switched(True):
        moe.prefill(torch.randint(0, moe.cfg.vocab_size, (1, 6)))
    assert counting == []


@pytest.mark.parametrize(("value", "phases"), [
    ("0", []), ("off", []), ("1", ["prefill", "decode"]), ("decode", ["decode"]),
    ("prefill,decode", ["prefill", "decode"]), ("all", ["prefill", "decode"]),
])
def test_env_values(monkeypatch: pytest.MonkeyPatch, value: str, phases: list[str]) -> None:
    monkeypatch.setenv("SPLITPHASE_COMPILE", value)
    assert sorted(compiled._env_phases()) == sorted(phases)


def test_off_without_env() -> None:
    env = {k: v for k, v in os.environ.items() if k != "SPLITPHASE_COMPILE"}
    code = "from splitphase.model import compiled; print(compiled.enabled_phases())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


def test_unknown_phase_is_refused() -> None:
    with pytest.raises(ValueError, match="compile phases"):
        compiled.set_enabled(True, ["training"])


def test_packed_prefill_linears_stay_out_of_the_graph(inductor, model, counting) -> None:
    prompt = torch.randint(0, model.cfg.vocab_size, (1, 40))  # prefill-shaped: 40 rows
    want = model.prefill(prompt)[0]
    counters.clear()
    with compiled.switched(True), packed_linear.switched(True):
        got = model.prefill(prompt)[0]
    assert len(counting) == 1 and not counters["graph_break"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_new_lengths_and_batches_reuse_the_graphs(inductor, model) -> None:
    compiled.PIECES.reset()
    counters.clear()
    # Inductor's on-disk cache adds the guards of the entry it finds: an entry another compile
    # left (another shape, older code) could add some, so this test compiles without it.
    no_disk_cache = torch._inductor.config.patch(fx_graph_cache=False)

    def run(shapes: list[tuple[int, int]]) -> int:
        with compiled.switched(True), decode_stack.switched(False), no_disk_cache:
            for b, t in shapes:
                _generate(model, torch.randint(0, model.cfg.vocab_size, (b, t)), 1)
        return counters["stats"]["unique_graphs"]

    graphs = run([(1, 20), (2, 30)])  # prefill lengths, decode batches 1 and 2
    assert run([(1, 40), (1, 57), (3, 25), (5, 33)]) == graphs  # no recompile
