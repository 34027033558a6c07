"""Prefill linears on packed weights (MKL's and oneDNN's) against torch's linear, and the model
with them."""

from __future__ import annotations

import copy
import os
import pickle
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from splitphase.hardware import cpuinfo
from splitphase.kernels import gemm_choice, packed_budget, packed_gemms, packed_linear
from splitphase.model.config import ModelConfig
from splitphase.model.layers import Linear
from splitphase.model.transformer import Transformer

needs_packed = pytest.mark.skipif(
    not packed_linear.available(), reason="this torch has no packed GEMM"
)
needs_mkl = pytest.mark.skipif(
    "mkl" not in packed_linear.backends(), reason="this torch has no MKL packed GEMM"
)


@pytest.fixture(params=list(packed_gemms.GEMMS))
def gemm(request: pytest.FixtureRequest) -> Iterator[str]:
    """The test runs once on each packed GEMM this torch has."""
    if request.param not in packed_linear.backends():
        pytest.skip(f"this torch has no {request.param} packed GEMM")
    with packed_linear.using_backend(request.param):
        yield request.param


@pytest.fixture(autouse=True)
def packing_on():
    """These tests switch packing on, in the packed GEMM's own form (whatever form would be
    timed fastest: tests/kernels/test_gemm_choice.py), and leave the process as they found it."""
    with packed_linear.switched(True), gemm_choice.forced("packed"):
        yield


@pytest.fixture
def packing_off(packing_on):
    with packed_linear.switched(False):
        yield


def _mode_in_child(value: str | None) -> tuple[str, str]:
    """(switch, budget limited) as a fresh process sees SPLITPHASE_PACKED_PREFILL=value."""
    code = (
        "from splitphase.kernels import packed_linear as p; print(p._SWITCH.on, p._BUDGET.limited)"
    )
    env = {k: v for k, v in os.environ.items() if k != "SPLITPHASE_PACKED_PREFILL"}
    if value is not None:
        env["SPLITPHASE_PACKED_PREFILL"] = value
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    return out.stdout.strip(), out.stderr


def test_auto_by_default_all_when_on_none_when_off():
    assert _mode_in_child(None)[0] == "True True"  # on, within the memory budget
    assert _mode_in_child("on")[0] == "True False"
    assert _mode_in_child("0")[0] == "False False"
    assert "must be auto, on or off" in _mode_in_child("sometimes")[1]


def _backend_in_child(value: str) -> tuple[str, str]:
    """(backend(), stderr) as a fresh process sees SPLITPHASE_PACKED_GEMM=value."""
    code = "from splitphase.kernels import packed_linear as p; print(p.backend())"
    env = {**os.environ, "SPLITPHASE_PACKED_GEMM": value}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    return out.stdout.strip(), out.stderr


@needs_packed
def test_the_environment_names_the_packed_gemm_or_the_probe_picks_one():
    for name in packed_linear.backends():
        assert _backend_in_child(name)[0] == name
    assert _backend_in_child("auto")[0] in packed_linear.backends()
    assert "must be auto, mkl or onednn" in _backend_in_child("cublas")[1]


def test_auto_leaves_the_vendors_backend_only_for_one_clearly_faster():
    margin = packed_linear.PROBE_MARGIN
    intel, amd = "GenuineIntel", "AuthenticAMD"
    assert packed_linear.pick({"mkl": 1.0, "onednn": 0.5}, intel) == "onednn"
    assert packed_linear.pick({"mkl": 1.0, "onednn": margin * 1.01}, intel) == "mkl"  # about level
    assert packed_linear.pick({"mkl": 1.0, "onednn": 2.0}, intel) == "mkl"
    # MKL runs its AVX2 code off Intel: oneDNN's stays unless MKL's is clearly faster
    assert packed_linear.pick({"mkl": 1.0, "onednn": 1.0 / 0.85}, amd) == "onednn"  # Zen 4
    assert packed_linear.pick({"mkl": margin * 0.99, "onednn": 1.0}, amd) == "mkl"
    # without AVX-512 both run AVX2 code: MKL's stays, as on Intel (Zen 3)
    assert packed_linear.pick({"mkl": 1.0, "onednn": 1.0 / 0.85}, amd, avx512=False) == "mkl"
    assert packed_linear.pick({"mkl": 1.0, "onednn": margin * 0.99}, amd, False) == "onednn"
    assert packed_linear.pick({"onednn": 3.0}, intel) == "onednn"  # the only one this torch has
    assert packed_linear.pick({"mkl": 3.0}, amd) == "mkl"


@needs_packed
def test_the_probe_alternates_the_backends_and_keeps_its_pick(monkeypatch) -> None:
    timed: list[str] = []

    def fake_probe(name: str) -> float:
        timed.append(name)
        # oneDNN's first turn in a slow spell: one timing each would pick MKL's
        slow_spell = 3.0 if name == "onednn" and timed.count(name) == 1 else 1.0
        return slow_spell * {"mkl": 2.0, "onednn": 1.0}[name]

    monkeypatch.setattr(packed_linear, "_probe_s", fake_probe)
    have = packed_linear.backends()
    with packed_linear.using_backend(have[0]):
        packed_linear.set_backend(None)  # probe again at the next use
        assert packed_linear.backend() == ("onednn" if len(have) == 2 else have[0])
        packed_linear.backend()
        assert timed == have * packed_linear.PROBE_ROUNDS  # in turns, then not again


@needs_packed
def test_the_real_probe_times_a_gemm(gemm: str) -> None:
    assert 0 < packed_linear._probe_s(gemm) < 1.0  # ~0.5 GFLOP: milliseconds on any CPU


@pytest.fixture
def budget(monkeypatch: pytest.MonkeyPatch) -> packed_budget.Budget:
    """A fresh `auto` budget for the test: its limit is set by the test, not by the machine."""
    fresh = packed_budget.Budget(limited=True)
    monkeypatch.setattr(packed_linear, "_BUDGET", fresh)
    return fresh


def test_auto_packs_within_its_budget_and_returns_the_bytes(budget, gemm: str) -> None:
    w1, w2, x = torch.randn(96, 64), torch.randn(96, 64), torch.randn(40, 64)
    budget.limit_bytes = 1
    refused = packed_linear.PackedWeight()
    with torch.no_grad():
        assert packed_linear.linear(x, w1, refused) is None  # no room: torch's linear
        budget.limit_bytes = 10**9
        assert packed_linear.linear(x, w1, refused) is None  # a refusal holds for that weight
        first = packed_linear.PackedWeight()
        assert packed_linear.linear(x, w1, first) is not None
        used = budget.used_bytes
        assert used >= w1.numel() * 4  # the packed copy is counted (MKL's ~2.2x the weight)
        budget.limit_bytes = used + 1  # room for that one only
        assert packed_linear.linear(x, w2, packed_linear.PackedWeight()) is None
        del first  # a dropped copy gives its bytes back
        assert budget.used_bytes == 0
        assert packed_linear.linear(x, w2, packed_linear.PackedWeight()) is not None


@pytest.mark.parametrize("in_features", [64, 768, 3072])
def test_one_packed_copy_serves_every_row_count(in_features: int, gemm: str) -> None:
    g = torch.Generator().manual_seed(in_features)
    w = torch.randn(96, in_features, generator=g) * 0.05
    pack = packed_linear.PackedWeight()
    with torch.inference_mode():
        for rows in (512, 32, 33, 300, 2048, 77):  # packed at 512, reused for the rest
            x = torch.randn(1, rows, in_features, generator=g)
            got = packed_linear.linear(x, w, pack)
            assert got is not None and got.shape == (1, rows, 96)
            torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)


@needs_mkl
@pytest.mark.parametrize("first_rows", [32, 2048])
def test_packs_for_pack_rows_whatever_the_first_call(first_rows: int, monkeypatch) -> None:
    """The layout is MKL's for PACK_ROWS: packed for the engine warm-up's 32 rows, every later
    512-row prefill GEMM ran 10-15% slower; packed for a 2048-token first prompt, half speed."""
    asked: list[int] = []
    real = torch.ops.mkl._mkl_reorder_linear_weight

    def spy(w: torch.Tensor, rows: int) -> torch.Tensor:
        asked.append(rows)
        return real(w, rows)

    monkeypatch.setattr(torch.ops.mkl, "_mkl_reorder_linear_weight", spy)
    w = torch.randn(48, 64)
    with torch.no_grad(), packed_linear.using_backend("mkl"):
        got = packed_linear.linear(torch.randn(first_rows, 64), w, packed_linear.PackedWeight())
    assert got is not None
    assert asked == [packed_gemms.PACK_ROWS]


@pytest.mark.skipif(len(packed_linear.backends()) < 2, reason="needs both packed GEMMs")
def test_a_copy_packed_by_one_backend_is_rebuilt_for_the_other() -> None:
    g = torch.Generator().manual_seed(3)
    ws = [torch.randn(n, 64, generator=g) for n in (48, 16, 16)]
    x = torch.randn(40, 64, generator=g)
    pack = packed_linear.PackedWeight()
    with torch.no_grad():
        for name, keeps_stack in (("mkl", True), ("onednn", False), ("mkl", True)):
            with packed_linear.using_backend(name):
                got = packed_linear.stacked_linear(x, ws, pack)
            torch.testing.assert_close(got, F.linear(x, torch.cat(ws)), rtol=1e-5, atol=1e-5)
            assert (pack._plain is not None) == keeps_stack  # oneDNN needs no plain stack
            stack_bytes = 80 * 64 * 4  # oneDNN's copy is the stack's size; MKL's is more, plus it
            assert pack.nbytes == stack_bytes if not keeps_stack else pack.nbytes > stack_bytes


def test_repacks_when_the_weight_changes(gemm: str) -> None:
    g = torch.Generator().manual_seed(0)
    lin = Linear(64, 48, bias=False)
    x = torch.randn(40, 64, generator=g)
    with torch.no_grad():
        first = lin.packed_forward(x)
        lin.weight.copy_(torch.randn(48, 64, generator=g))  # in place: load_state_dict, optimizer
        in_place = lin.packed_forward(x)
        lin.weight.data = torch.randn(48, 64, generator=g)  # replaced: .to(), .data =
        replaced = lin.packed_forward(x)
        for got in (in_place, replaced):
            assert got is not None
        torch.testing.assert_close(replaced, F.linear(x, lin.weight), rtol=1e-5, atol=1e-5)
    assert first is not None and not torch.allclose(first, in_place)  # type: ignore[arg-type]


@needs_packed
def test_falls_back_where_it_does_not_apply() -> None:
    w = torch.randn(48, 64)
    pack = packed_linear.PackedWeight()
    below = packed_linear.min_rows(w.dtype) - 1
    assert packed_linear.linear(torch.randn(below, 64), w, pack) is None
    assert packed_linear.linear(torch.randn(64, 64).half(), w.half(), pack) is None  # no fp16
    assert packed_linear.linear(torch.randn(64, 64).bfloat16(), w, pack) is None  # mixed
    trained = torch.randn(48, 64, requires_grad=True)  # autograd needs torch's linear
    assert packed_linear.linear(torch.randn(64, 64), trained, pack) is None
    packed_linear.set_enabled(False)
    try:
        assert packed_linear.linear(torch.randn(64, 64), w, pack) is None
    finally:
        packed_linear.set_enabled(True)


def test_stacked_weights_are_one_gemm_over_their_concatenation(gemm: str) -> None:
    g = torch.Generator().manual_seed(1)
    ws = [torch.randn(n, 64, generator=g) for n in (48, 16, 16)]
    x = torch.randn(2, 40, 64, generator=g)
    pack = packed_linear.PackedWeight()
    with torch.no_grad():
        got = packed_linear.stacked_linear(x, ws, pack)
        assert got is not None and got.shape == (2, 40, 80)
        torch.testing.assert_close(got, F.linear(x, torch.cat(ws)), rtol=1e-5, atol=1e-5)
        ws[1].mul_(2)  # one member changed in place: the stack is rebuilt
        again = packed_linear.stacked_linear(x, ws, pack)
        torch.testing.assert_close(again, F.linear(x, torch.cat(ws)), rtol=1e-5, atol=1e-5)


@needs_packed
def test_copies_and_pickles_start_empty() -> None:
    lin = Linear(64, 48, bias=False)
    with torch.no_grad():
        assert lin.packed_forward(torch.randn(64, 64)) is not None
    assert lin.packed._packed is not None
    for clone in (copy.deepcopy(lin), pickle.loads(pickle.dumps(lin))):
        assert clone.packed._packed is None
        with torch.no_grad():
            got = clone.packed_forward(torch.ones(64, 64))
        torch.testing.assert_close(got, F.linear(torch.ones(64, 64), lin.weight))


def _tiny() -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig.from_name("tiny").with_(dtype="float32")
    return Transformer(cfg).eval()


def test_model_prefill_and_generate_match_torch_linears(gemm: str) -> None:
    model = _tiny()
    prompt = torch.randint(0, model.cfg.vocab_size, (2, 70)).tolist()
    ids = torch.tensor(prompt)
    packed_logits, _ = model.prefill(ids)
    layer = model.layers[0]
    assert layer.self_attn.qkv_packed._packed is not None  # the paths ran: Q/K/V stacked,
    assert layer.mlp.gate_proj.packed._packed is not None  # gate and up one GEMM each
    packed_tokens = model.generate(prompt[0], 12)
    packed_linear.set_enabled(False)
    try:
        torch_logits, _ = model.prefill(ids)
        torch_tokens = model.generate(prompt[0], 12)
    finally:
        packed_linear.set_enabled(True)
    torch.testing.assert_close(packed_logits, torch_logits, rtol=1e-4, atol=1e-5)
    assert packed_tokens == torch_tokens


needs_onednn = pytest.mark.skipif(
    "onednn" not in packed_linear.backends(), reason="this torch has no oneDNN packed GEMM"
)


needs_onednn_bf16 = pytest.mark.skipif(
    not packed_gemms.takes("onednn", torch.bfloat16),
    reason="no oneDNN bf16 packed GEMM here (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)",
)


def test_a_gemm_that_raises_on_a_dtype_does_not_take_it(monkeypatch) -> None:
    def refuse(w: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("bf16 path needs the cpu support avx512bw")

    real = packed_gemms.GEMMS["onednn"]
    monkeypatch.setitem(packed_gemms.GEMMS, "onednn", real._replace(pack=refuse))
    monkeypatch.setattr(packed_gemms, "HAVE", ("onednn",))
    assert not packed_gemms.takes.__wrapped__("onednn", torch.bfloat16)
    assert not packed_gemms.takes.__wrapped__("onednn", torch.float16)  # not listed
    monkeypatch.setitem(packed_gemms.GEMMS, "onednn", real)
    if "onednn" in packed_linear.backends():
        assert packed_gemms.takes.__wrapped__("onednn", torch.float32)


@needs_onednn
def test_onednn_does_not_take_bf16_on_a_cpu_without_bf16_instructions(monkeypatch) -> None:
    # Its bf16 GEMM would run there, emulated, at a fifth of the fp32 one's rate.
    monkeypatch.setattr(cpuinfo, "_first_cpu",
                        lambda: {"flags": "avx2 fma avx512f avx512bw avx512vl avx512dq"})
    assert not packed_gemms.takes.__wrapped__("onednn", torch.bfloat16)
    assert packed_gemms.takes.__wrapped__("onednn", torch.float32)


def test_where_no_gemm_takes_bf16_it_widens_to_the_fp32_one(
    gemm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = packed_linear.backend_for
    monkeypatch.setattr(packed_linear, "backend_for",
                        lambda dtype: None if dtype == torch.bfloat16 else real(dtype))
    assert packed_linear.widened_backend(torch.bfloat16) == gemm
    assert packed_linear.widened_backend(torch.float32) is None
    assert packed_linear.min_rows(torch.bfloat16) == packed_linear.MIN_ROWS
    g = torch.Generator().manual_seed(6)
    ws = [(torch.randn(n, 256, generator=g) * 0.05).bfloat16() for n in (96, 32)]
    pack = packed_linear.PackedWeight()
    with torch.no_grad():
        x = torch.randn(2, 300, 256, generator=g).bfloat16()
        got = packed_linear.stacked_linear(x, ws, pack)
        assert got is not None and got.dtype == torch.bfloat16 and got.shape == (2, 300, 128)
        exact = x.double() @ torch.cat(ws).double().T  # products of bf16 values are exact
        torch.testing.assert_close(got.double(), exact, rtol=2**-8, atol=1e-5)  # one rounding
        assert packed_linear.linear(x[:, :10], ws[0], packed_linear.PackedWeight()) is None
    assert pack.nbytes >= 128 * 256 * 4  # an fp32 copy, counted against the budget
    if gemm == "mkl":  # MKL's op keeps the plain weight for its fallback: the fp32 stack
        assert pack._plain is not None and pack._plain.dtype == torch.float32


@pytest.mark.skipif(packed_gemms.takes("onednn", torch.bfloat16), reason="bf16 packs here")
def test_without_a_bf16_packed_gemm_the_bf16_model_widens_its_prefill_linears() -> None:
    assert packed_linear.backend_for(torch.bfloat16) is None
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name("tiny").with_(dtype="bfloat16")).eval()
    ids = torch.randint(0, model.cfg.vocab_size, (2, 70))
    packed_logits, _ = model.prefill(ids)
    assert model.layers[0].self_attn.qkv_packed._packed is not None
    assert model.layers[0].self_attn.qkv_packed._packed.dtype == torch.float32
    with packed_linear.switched(False):
        torch_logits, _ = model.prefill(ids)
    torch.testing.assert_close(packed_logits, torch_logits, rtol=2e-2, atol=2e-2)


@needs_onednn_bf16
@pytest.mark.parametrize("fp32_gemm", packed_linear.backends())
def test_bf16_packs_with_onednn_whatever_fp32_took(fp32_gemm: str) -> None:
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(96, 768, generator=g) * 0.05).bfloat16()
    pack = packed_linear.PackedWeight()
    with torch.no_grad(), packed_linear.using_backend(fp32_gemm):
        assert packed_linear.backend_for(torch.bfloat16) == "onednn"
        for rows in (512, 40):
            x = torch.randn(rows, 768, generator=g).bfloat16()
            got = packed_linear.linear(x, w, pack)
            assert got is not None and got.dtype == torch.bfloat16
            torch.testing.assert_close(got, F.linear(x, w))
    assert pack._plain is None and pack.nbytes == w.numel() * 2


@needs_onednn_bf16
def test_bf16_model_prefill_matches_torch_linears() -> None:
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name("tiny").with_(dtype="bfloat16")).eval()
    ids = torch.randint(0, model.cfg.vocab_size, (2, 70))
    packed_logits, _ = model.prefill(ids)
    assert model.layers[0].self_attn.qkv_packed._packed is not None
    with packed_linear.switched(False):
        torch_logits, _ = model.prefill(ids)
    torch.testing.assert_close(packed_logits, torch_logits, rtol=2e-2, atol=2e-2)


@needs_packed
def test_training_forward_keeps_torch_linear_and_gradients() -> None:
    model = _tiny().train()
    ids = torch.randint(0, model.cfg.vocab_size, (2, 40))
    model(ids).sum().backward()
    q = model.layers[0].self_attn.q_proj
    assert q.weight.grad is not None and q.packed._packed is None


def test_flop_counter_counts_the_packed_gemm_as_a_linear(gemm: str) -> None:
    from torch.utils.flop_counter import FlopCounterMode

    x, w = torch.randn(2, 40, 64), torch.randn(48, 64)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        assert packed_linear.linear(x, w, packed_linear.PackedWeight()) is not None
    assert counter.get_total_flops() == 2 * 80 * 64 * 48
