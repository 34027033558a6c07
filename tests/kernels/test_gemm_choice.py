"""The timed choice of a prefill linear's form (packed, split in row pieces, torch's linear)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Sequence

import pytest
import torch
import torch.nn.functional as F

from splitphase.errors import UserError
from splitphase.kernels import gemm_choice, packed_linear
from splitphase.model.config import ModelConfig
from splitphase.model.transformer import Transformer
from splitphase.perf import peaks

needs_packed = pytest.mark.skipif(
    not packed_linear.available(), reason="this torch has no packed GEMM"
)


@pytest.fixture(autouse=True)
def fresh_choices() -> Iterator[None]:
    """Each test starts with no choice made, the timed choice on and packing on."""
    gemm_choice.reset()
    with gemm_choice.forced(None), packed_linear.switched(True):
        yield
    gemm_choice.reset()


class FakeClock:
    """perf_counter for the probe: each form's run advances it by that form's cost."""

    def __init__(self, costs: dict[str, float]) -> None:
        self.costs, self.now, self.calls = costs, 0.0, []

    def __call__(self) -> float:
        return self.now

    def form(self, name: str):
        def run(x: torch.Tensor, ws: Sequence[torch.Tensor], packed) -> torch.Tensor:
            self.calls.append(name)
            self.now += self.costs[name]
            return torch.full((1,), float(len(self.calls)))

        return run


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch):
    def make(costs: dict[str, float]) -> FakeClock:
        fake = FakeClock(costs)
        monkeypatch.setattr(gemm_choice.time, "perf_counter", fake)
        monkeypatch.setattr(gemm_choice, "_RUN", {f: fake.form(f) for f in gemm_choice.FORMS})
        return fake

    return make


def _big(rows: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """x and one weight whose product is timed (over MIN_TIMED_FLOPS)."""
    return torch.zeros(rows, 512), [torch.zeros(512, 512)]


def test_buckets_are_exact_for_decode_then_multiples_of_64_then_powers_of_two() -> None:
    assert [gemm_choice.bucket(r) for r in (1, 5, 64)] == [1, 5, 64]
    assert [gemm_choice.bucket(r) for r in (65, 128, 129, 2048)] == [128, 128, 192, 2048]
    assert [gemm_choice.bucket(r) for r in (2049, 4096, 5000)] == [4096, 4096, 8192]


def test_split_is_a_candidate_only_above_split_rows() -> None:
    assert gemm_choice.candidates(gemm_choice.SPLIT_ROWS) == ["packed", "torch"]
    assert gemm_choice.candidates(gemm_choice.SPLIT_ROWS + 1) == ["packed", "split", "torch"]


def test_another_form_replaces_packed_only_when_clearly_faster() -> None:
    m = gemm_choice.MARGIN
    assert gemm_choice.pick({"packed": 1.0, "split": m * 1.01, "torch": 2.0}) == "packed"
    assert gemm_choice.pick({"packed": 1.0, "split": m * 0.99, "torch": 2.0}) == "split"
    assert gemm_choice.pick({"packed": 1.0, "split": 0.5, "torch": 0.4}) == "torch"
    assert gemm_choice.pick({"packed": 1.0, "torch": 3.0}) == "packed"


def test_the_probe_alternates_the_forms_then_keeps_its_pick(clock) -> None:
    fake = clock({"packed": 2.0, "split": 1.0, "torch": 3.0})
    x, ws = _big(512)
    first = gemm_choice.run(x, ws, lambda a: a)
    assert fake.calls == ["packed", "split", "torch"] * gemm_choice.ROUNDS
    # The probe hands back the chosen form's own product (its last run), not a recomputation.
    assert first is not None and first.item() == 3 * gemm_choice.ROUNDS - 1
    assert gemm_choice.run(torch.zeros(500, 512), ws, lambda a: a) is not None  # same bucket
    assert fake.calls[3 * gemm_choice.ROUNDS:] == ["split"]
    threads = torch.get_num_threads()
    assert gemm_choice.chosen() == {f"float32 512x512 @512 rows, {threads} threads": "split"}


def test_torch_chosen_hands_the_product_back_to_the_caller(clock) -> None:
    fake = clock({"packed": 2.0, "split": 2.0, "torch": 1.0})
    x, ws = _big(512)
    assert gemm_choice.run(x, ws, lambda a: a) is None
    assert gemm_choice.run(x, ws, lambda a: a) is None
    assert len(fake.calls) == 3 * gemm_choice.ROUNDS  # timed once


def test_each_bucket_dtype_and_shape_is_its_own_choice(clock) -> None:
    fake = clock({"packed": 1.0, "split": 2.0, "torch": 2.0})
    x, ws = _big(512)
    gemm_choice.run(x, ws, lambda a: a)
    gemm_choice.run(torch.zeros(1024, 512), ws, lambda a: a)
    gemm_choice.run(x.bfloat16(), [ws[0].bfloat16()], lambda a: a)
    gemm_choice.run(x, [torch.zeros(256, 512)], lambda a: a)
    assert len(gemm_choice.chosen()) == 4 and set(gemm_choice.chosen().values()) == {"packed"}
    assert len(fake.calls) == 4 * 3 * gemm_choice.ROUNDS


def test_small_products_keep_packed_untimed(clock) -> None:
    fake = clock({"packed": 2.0, "split": 1.0, "torch": 1.0})
    x, w = torch.zeros(300, 64), torch.zeros(64, 64)  # 2.5 MFLOP
    assert gemm_choice.run(x, [w], lambda a: a + 1) is not None
    assert fake.calls == ["packed"] and gemm_choice.chosen() == {}  # run once, not timed


def test_forced_forms_run_without_timing(clock) -> None:
    fake = clock({"packed": 1.0, "split": 1.0, "torch": 1.0})
    x, ws = _big(512)
    with gemm_choice.forced("torch"):
        assert gemm_choice.run(x, ws, lambda a: a) is None
    with gemm_choice.forced("split"):
        gemm_choice.run(x, ws, lambda a: a)
        gemm_choice.run(torch.zeros(100, 512), ws, lambda a: a)  # too few rows to split
    assert fake.calls == ["split", "packed"] and gemm_choice.chosen() == {}
    with pytest.raises(UserError), gemm_choice.forced("tiled"):
        pass


def test_split_computes_the_product_in_equal_row_pieces() -> None:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 300, 48, generator=g), torch.randn(40, 48, generator=g)
    pieces: list[int] = []

    def packed(a: torch.Tensor) -> torch.Tensor:
        pieces.append(a.shape[0])
        return F.linear(a, w)

    got = gemm_choice._split(x, [w], packed)
    assert pieces == [200, 200, 200]  # 600 rows, at most SPLIT_ROWS each, no short remainder
    torch.testing.assert_close(got, F.linear(x, w))
    assert gemm_choice._torch(x, [w, w[:8]], packed).shape == (2, 300, 48)


@needs_packed
@pytest.mark.parametrize("form", gemm_choice.FORMS)
def test_every_form_of_a_stacked_linear_computes_the_product(form: str) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(600, 64, generator=g)
    ws = [torch.randn(48, 64, generator=g), torch.randn(16, 64, generator=g)]
    with gemm_choice.forced(form):
        got = packed_linear.stacked_linear(x, ws, packed_linear.PackedWeight())
    if form == "torch":
        assert got is None  # the caller's torch path
    else:
        assert got is not None
        torch.testing.assert_close(got, F.linear(x, torch.cat(ws)), rtol=1e-4, atol=1e-4)


@needs_packed
def test_model_prefill_agrees_in_every_form(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gemm_choice, "SPLIT_ROWS", 40)  # the tiny model's prompt splits
    monkeypatch.setattr(gemm_choice, "MIN_TIMED_FLOPS", 0)  # and its products are timed
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name("tiny").with_(dtype="float32")).eval()
    ids = torch.randint(0, model.cfg.vocab_size, (1, 100))
    logits = {}
    for form in (*gemm_choice.FORMS, None):
        with gemm_choice.forced(form):
            logits[form], _ = model.prefill(ids)
    assert len(gemm_choice.chosen()) >= 4  # None: Q/K/V stacked, O, gate/up, down were timed
    for form in gemm_choice.FORMS:
        torch.testing.assert_close(logits[form], logits[None], rtol=1e-4, atol=1e-5)


@needs_packed
def test_the_peak_times_the_packed_forms_whatever_is_forced() -> None:
    x, w = torch.randn(300, 256), torch.randn(256, 256)
    with gemm_choice.forced("torch"):  # as SPLITPHASE_GEMM_FORM=torch would
        seconds = peaks._packed_forms_s(x, w, repeats=2)
        assert gemm_choice._forced == "torch"
    assert 0 < seconds < 1.0


@pytest.mark.parametrize(
    ("value", "forced"), [(None, "None"), ("auto", "None"), ("Split", "split")]
)
def test_the_environment_forces_a_form_for_the_process(value: str | None, forced: str) -> None:
    code = "from splitphase.kernels import gemm_choice; print(gemm_choice._forced)"
    env = {k: v for k, v in os.environ.items() if k != "SPLITPHASE_GEMM_FORM"}
    if value is not None:
        env["SPLITPHASE_GEMM_FORM"] = value
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == forced


def test_an_unknown_form_in_the_environment_is_refused() -> None:
    env = {**os.environ, "SPLITPHASE_GEMM_FORM": "tiled"}
    code = "import splitphase.kernels.gemm_choice"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "SPLITPHASE_GEMM_FORM must be auto" in out.stderr


def test_a_flop_counter_sees_one_product_not_the_probe(clock) -> None:
    from torch.utils.flop_counter import FlopCounterMode

    fake = clock({"packed": 2.0, "split": 1.0, "torch": 1.0})
    x, ws = _big(512)
    with FlopCounterMode(display=False):
        gemm_choice.run(x, ws, lambda a: a)
    assert fake.calls == ["packed"] and gemm_choice.chosen() == {}  # nothing timed or kept
