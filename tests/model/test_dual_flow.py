"""Dual-Flow Transformer (issue 8): the primary is the baseline, the aux adds no cache, and the
phases (teacher-forced, prefill, grouped and separate decode) agree."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from splitphase.audit import flops
from splitphase.model.attention_context import KVCache
from splitphase.model.checkpoint import build_model, load_model, save_checkpoint
from splitphase.model.config import ConfigError, ModelConfig
from splitphase.model.dual_flow import DualFlowTransformer, mix_readout
from splitphase.model.transformer import Transformer

PRESETS = ["tiny", "tiny-moe"]
# (preset, config changes): every execution path the phase-equality tests cover.
VARIANTS = [
    ("tiny", {}),
    ("tiny", {"aux_self_kv": True}),
    ("tiny", {"coupling": "ac", "readout": "aux"}),
    ("tiny-moe", {}),
    ("tiny-moe", {"aux_routing": "replay"}),
    ("tiny-moe", {"aux_top_k": 3, "aux_self_kv": True}),
]


def dual(preset: str = "tiny", live_couplings: bool = True, **changes: Any) -> DualFlowTransformer:
    """A tiny Dual-Flow model; live_couplings gives a, b, c random values so they matter."""
    torch.manual_seed(0)
    cfg = ModelConfig.from_name(preset).with_(arch="dual_flow", **changes)
    model = DualFlowTransformer(cfg).eval()
    if live_couplings:
        with torch.no_grad():
            for p in model.couplings.parameters():
                p.normal_(std=0.5)
    return model


def baseline_of(model: DualFlowTransformer) -> Transformer:
    """The plain Transformer with the Dual-Flow model's shared weights."""
    base = Transformer(model.cfg.with_(arch="baseline")).eval()
    shared = base.state_dict().keys()
    base.load_state_dict({k: v for k, v in model.state_dict().items() if k in shared})
    return base


def ids_for(model: Transformer, batch: int = 2, length: int = 12) -> torch.Tensor:
    return torch.randint(0, model.cfg.vocab_size, (batch, length), generator=torch.Generator())


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> None:
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)


# ---------------------------------------------------------------- the primary is the baseline


@pytest.mark.parametrize("preset", PRESETS)
def test_primary_is_bit_identical_to_baseline_and_to_aux_off(preset: str) -> None:
    model = dual(preset)
    ids, base = ids_for(model), baseline_of(model)
    with torch.no_grad():
        assert torch.equal(model.forward_flows(ids).logits_p, base(ids))
    runs = {}
    for name, aux in (("on", True), ("off", False)):
        model.aux_enabled = aux
        out, cache = model.prefill_flows(ids[:, :5])
        steps = [out.logits_p]
        for t in range(5, 12):
            steps.append(model.decode_flows(ids[:, t], cache, grouped=False).logits_p)
        runs[name] = (torch.stack(steps, 1), cache)
    logits, cache = base.prefill(ids[:, :5])
    base_steps = [logits] + [base.decode_step(ids[:, t], cache) for t in range(5, 12)]
    for logits_p, dual_cache in runs.values():
        assert torch.equal(logits_p, torch.stack(base_steps, 1))
        assert torch.equal(dual_cache.k, cache.k) and torch.equal(dual_cache.v, cache.v)


# With independent MoE routing the aux's expert picks set each expert GEMM's row count, which
# moves the primary rows' rounding under default MKL; replay fixes the counts (the strict-mode
# test below covers independent routing bit for bit).
@pytest.mark.parametrize(
    ("preset", "changes"), [("tiny", {}), ("tiny-moe", {"aux_routing": "replay"})]
)
def test_grouped_decode_primary_reads_no_aux_state(preset: str, changes: dict[str, Any]) -> None:
    model = dual(preset, **changes)
    ids = ids_for(model)
    other = dual(preset, **changes)
    with torch.no_grad():  # different aux-only state: embedding and couplings
        other.embed_aux.weight.normal_()
        for p in other.couplings.parameters():
            p.normal_(std=2.0)
    base = baseline_of(model)
    _, c1 = model.prefill_flows(ids[:, :5])
    _, c2 = other.prefill_flows(ids[:, :5])
    _, c3 = base.prefill(ids[:, :5])
    for t in range(5, 9):
        a, b = model.decode_flows(ids[:, t], c1), other.decode_flows(ids[:, t], c2)
        assert torch.equal(a.logits_p, b.logits_p) and not torch.equal(a.logits_q, b.logits_q)
        # Grouped GEMMs have 2B rows; default MKL rounds them unlike B rows (see the next test).
        close(a.logits_p, base.decode_step(ids[:, t], c3), 1e-6)
    assert torch.equal(c1.k, c2.k) and torch.equal(c1.v, c2.v)
    close(c1.k, c3.k, 1e-6)


STRICT_SCRIPT = """
import sys
import torch
from test_dual_flow import baseline_of, dual, ids_for
w, x = torch.randn(128, 64), torch.randn(6, 64)
if not torch.equal((x[:1] @ w.T)[0], (x @ w.T)[0]):
    print("MKL gives no row-count-independent GEMM on this CPU")
    sys.exit(0)
variants = [
    ("tiny", {}),
    ("tiny", {"aux_self_kv": True}),
    ("tiny-moe", {}),
    ("tiny-moe", {"aux_routing": "replay"}),
]
for preset, changes in variants:
    for batch in (1, 2, 3):
        model = dual(preset, **changes)
        base = baseline_of(model)
        ids = ids_for(model, batch)
        _, cache = model.prefill_flows(ids[:, :5])
        _, ref = base.prefill(ids[:, :5])
        for t in range(5, 9):
            got = model.decode_flows(ids[:, t], cache, grouped=True).logits_p
            assert torch.equal(got, base.decode_step(ids[:, t], ref)), (preset, batch, t)
        assert torch.equal(cache.k, ref.k) and torch.equal(cache.v, ref.v), (preset, batch)
print("bitwise")
"""


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="needs torch built with MKL")
def test_grouped_decode_is_bit_identical_under_mkl_strict_reproducibility() -> None:
    # MKL's strict conditional-numerical-reproducibility mode makes a GEMM row's result
    # independent of the row count, so the grouped step ([x_pri; x_aux], 2B rows) keeps the
    # primary bit-identical to the plain model's B-row step. It must be set before MKL loads.
    env = {**os.environ, "MKL_CBWR": "AUTO,STRICT"}
    script = textwrap.dedent(STRICT_SCRIPT)
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=Path(__file__).parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if "no row-count-independent" in done.stdout:
        # Seen on an AMD Zen 5 host: MKL's strict mode left 1- and 6-row GEMMs an ulp apart
        # (its reproducibility is documented for Intel CPUs), so the premise does not hold.
        pytest.skip(done.stdout.strip())
    assert done.returncode == 0 and "bitwise" in done.stdout, done.stderr[-2000:]


# ---------------------------------------------------------------- no aux cache, one aux position


@pytest.mark.parametrize("preset", PRESETS)
def test_prefill_runs_aux_at_last_position_only_and_allocates_no_cache(
    preset: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = dual(preset)
    ids = ids_for(model, 2, 9)
    caches: list[KVCache] = []
    queries: list[tuple[int, ...]] = []
    init, cached = KVCache.__init__, KVCache.attend_cached

    def counting_init(self: KVCache, *args: Any) -> None:
        caches.append(self)
        init(self, *args)

    def recording(self: KVCache, layer_idx: int, attn: Any, q: torch.Tensor, *rest: Any) -> Any:
        queries.append(tuple(q.shape))
        return cached(self, layer_idx, attn, q, *rest)

    monkeypatch.setattr(KVCache, "__init__", counting_init)
    monkeypatch.setattr(KVCache, "attend_cached", recording)
    aux_inputs: list[tuple[int, ...]] = []
    model.embed_aux.register_forward_hook(lambda m, args, out: aux_inputs.append(args[0].shape))
    _, cache = model.prefill(ids)
    assert aux_inputs == [(2, 1)]  # one aux position per row: the last prompt token
    h, d = model.cfg.n_heads, model.cfg.head_dim
    assert queries == [(2, 1, h, d)] * model.cfg.n_layers
    assert len(caches) == 1  # only the primary's
    base_cache = baseline_of(model).new_cache(2, model.cfg.max_seq_len)
    assert cache.nbytes == base_cache.nbytes
    assert cache.nbytes == flops.kv_bytes_per_token(model.cfg, 4) * 2 * model.cfg.max_seq_len
    assert flops.kv_bytes_per_token(model.cfg) == flops.kv_bytes_per_token(baseline_of(model).cfg)
    allocated = len(caches)
    model.decode_step(ids[:, 0], cache)
    assert aux_inputs[-1] == (2, 1) and len(caches) == allocated and cache.length == 10


# ---------------------------------------------------------------- phases agree


@pytest.mark.parametrize(("preset", "changes"), VARIANTS)
def test_grouped_decode_equals_separate(preset: str, changes: dict[str, Any]) -> None:
    model = dual(preset, **changes)
    ids = ids_for(model)
    _, grouped_cache = model.prefill_flows(ids[:, :4])
    _, separate_cache = model.prefill_flows(ids[:, :4])
    for t in range(4, 9):
        grouped = model.decode_flows(ids[:, t], grouped_cache, grouped=True)
        separate = model.decode_flows(ids[:, t], separate_cache, grouped=False)
        for a, b in zip(grouped, separate, strict=True):
            close(a, b)
    # The public wrappers are the same two paths.
    close(
        model.decode_step(ids[:, 9], grouped_cache),
        model.decode_step_separate(ids[:, 9], separate_cache),
    )
    close(grouped_cache.k, separate_cache.k)


@pytest.mark.parametrize(("preset", "changes"), VARIANTS)
def test_prefill_and_decode_equal_teacher_forced_forward(
    preset: str, changes: dict[str, Any]
) -> None:
    model = dual(preset, **changes)
    ids = ids_for(model, 2, 11)
    with torch.no_grad():
        full = model.forward_flows(ids)  # (B, T, V) per field
    out, cache = model.prefill_flows(ids[:, :5])
    steps = [out] + [model.decode_flows(ids[:, t], cache) for t in range(5, 11)]
    for field in range(4):  # logits_p, logits_q, log_probs, alpha
        close(torch.stack([s[field] for s in steps], 1), full[field][:, 4:])
    with torch.no_grad():
        assert torch.equal(model(ids), full.log_probs)


def test_chunked_prefill_equals_one_prefill() -> None:
    model = dual("tiny")
    ids = ids_for(model, 1, 12)
    one, _ = model.prefill(ids)
    cache = model.new_cache(1, 32)
    model.prefill(ids[:, :7], cache)
    two, _ = model.prefill(ids[:, 7:], cache)
    close(one, two)


@pytest.mark.parametrize("preset", PRESETS)
def test_zero_coupling_aux_readout_with_shared_embedding_is_a_primary_pass(preset: str) -> None:
    model = dual(preset, live_couplings=False, readout="aux")
    ids = ids_for(model)
    with torch.no_grad():
        model.embed_aux.weight.copy_(model.embed_tokens.weight)
        full = model.forward_flows(ids)
    close(full.logits_q, full.logits_p)
    close(full.log_probs, F.log_softmax(full.logits_p, -1))
    out, cache = model.prefill_flows(ids[:, :6])
    step = model.decode_flows(ids[:, 6], cache)
    close(out.logits_q, out.logits_p)
    close(step.logits_q, step.logits_p)


def test_aux_self_kv_changes_the_aux_flow() -> None:
    ids = ids_for(dual("tiny"))
    with torch.no_grad():
        plain, own = (
            dual("tiny").forward_flows(ids),
            dual("tiny", aux_self_kv=True).forward_flows(ids),
        )
    assert torch.equal(plain.logits_p, own.logits_p)
    assert (plain.logits_q - own.logits_q).abs().max() > 1e-3


# ---------------------------------------------------------------- readout, training, checkpoints


def test_mix_readout_is_the_mixture_and_finite_at_full_confidence() -> None:
    torch.manual_seed(1)
    lp, lq = torch.randn(3, 5, 40), torch.randn(3, 5, 40)
    log_mix, alpha = mix_readout(lp, lq, "mix", 0.5)
    p, q = lp.softmax(-1), lq.softmax(-1)
    want_alpha = p.pow(2).sum(-1).clamp(0.5, 1.0)
    close(alpha, want_alpha)
    close(log_mix.exp(), want_alpha[..., None] * p + (1 - want_alpha[..., None]) * q)
    aux, _ = mix_readout(lp, lq, "aux", 0.5)
    close(aux, F.log_softmax(lq, -1))
    sure = torch.zeros(1, 40, requires_grad=True)
    logits = sure + torch.nn.functional.one_hot(torch.tensor([3]), 40) * 200.0  # p is one-hot
    log_mix, alpha = mix_readout(logits, torch.randn(1, 40), "mix", 0.5)
    assert alpha.item() == 1.0
    F.nll_loss(log_mix, torch.tensor([3])).backward()
    assert sure.grad is not None and torch.isfinite(sure.grad).all()


def test_cross_entropy_on_the_output_is_the_nll_of_p() -> None:
    model = dual("tiny")
    ids = ids_for(model, 2, 10)
    with torch.no_grad():
        log_probs = model(ids[:, :-1])  # (B, T, V)
    assert log_probs.dtype == torch.float32
    close(log_probs.exp().sum(-1), torch.ones(2, 9))
    ce = F.cross_entropy(log_probs.transpose(1, 2), ids[:, 1:], reduction="none")
    close(ce, -log_probs.gather(-1, ids[:, 1:, None])[..., 0], 1e-6)


def test_aux_disabled_predicts_with_the_primary_alone() -> None:
    model = dual("tiny")
    model.aux_enabled = False
    base, ids = baseline_of(model), ids_for(model)
    with torch.no_grad():
        assert torch.equal(model(ids), F.log_softmax(base(ids), -1))
    log_p, cache = model.prefill(ids[:, :4])
    logits, ref = base.prefill(ids[:, :4])
    assert torch.equal(log_p, F.log_softmax(logits, -1))
    assert torch.equal(
        model.decode_step(ids[:, 4], cache), F.log_softmax(base.decode_step(ids[:, 4], ref), -1)
    )


def test_build_model_and_checkpoint_roundtrip(tmp_path: Path) -> None:
    cfg = ModelConfig.from_name("tiny-moe").with_(arch="dual_flow", coupling="abc")
    built = build_model(cfg)
    assert isinstance(built, DualFlowTransformer) and built.has_aux_flow
    model = dual("tiny-moe", aux_routing="replay")
    save_checkpoint(model, tmp_path / "m")
    loaded = load_model(str(tmp_path / "m"))
    assert isinstance(loaded, DualFlowTransformer) and loaded.cfg == model.cfg
    ids = ids_for(model)
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
    with pytest.raises(ConfigError, match="arch='dual_flow'"):
        DualFlowTransformer(ModelConfig.from_name("tiny"))


def test_trainer_trains_and_evaluates_a_dual_flow_model(tmp_path: Path) -> None:
    from splitphase.training.trainer import TrainConfig, Trainer

    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 500, size=3000).astype(np.uint16)
    cfg = TrainConfig(
        preset="tiny",
        arch="dual_flow",
        steps=5,
        batch_size=2,
        seq_len=16,
        warmup_steps=1,
        eval_interval=5,
        eval_max_tokens=256,
        amp="none",
        device="cpu",
    )
    trainer = Trainer(cfg, tokens, tokens[:600], None, tmp_path)
    assert isinstance(trainer.model, DualFlowTransformer)
    summary = trainer.train(progress=False)
    assert np.isfinite(summary["val_loss"]) and summary["steps"] == 5
    moved = [p.abs().max().item() for p in trainer.model.couplings.parameters()]
    assert max(moved) > 0  # the zero-initialised couplings receive gradient
    loaded = load_model(str(trainer.save(summary)))
    assert isinstance(loaded, DualFlowTransformer)


def test_generate_greedy_is_argmax_of_the_teacher_forced_mixture() -> None:
    model = dual("tiny")
    prompt = [1, 2, 3, 4]
    out = model.generate(prompt, max_new_tokens=5)
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(5):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert out == seq[len(prompt) :]


@pytest.mark.parametrize("preset", PRESETS)
def test_bf16_model_runs(preset: str) -> None:
    model = dual(preset, dtype="bfloat16")
    ids = ids_for(model, 1, 6)
    log_p, cache = model.prefill(ids)
    step = model.decode_flows(ids[:, 0], cache)
    with torch.no_grad():
        full = model.forward_flows(ids)
    assert step.logits_p.dtype == torch.bfloat16 and step.log_probs.dtype == torch.float32
    for t in (log_p, step.log_probs, full.log_probs):
        assert torch.isfinite(t).all()


def test_aux_self_kv_needs_a_context_that_serves_it() -> None:
    from splitphase.model.attention_context import AuxAttentionContext
    from splitphase.model.dual_flow_layers import aux_attend

    class ReadOnly:  # an engine context without the aux_self_kv variant
        def attend(self, *args: Any) -> torch.Tensor:
            raise NotImplementedError

        def attend_cached(self, layer_idx: int, attn: Any, q: torch.Tensor) -> torch.Tensor:
            return q.flatten(2)

    ctx: AuxAttentionContext = ReadOnly()
    q, kv = torch.zeros(1, 1, 4, 16), torch.zeros(1, 1, 2, 16)
    attn = dual("tiny").layers[0].self_attn
    assert aux_attend(ctx, 0, attn, q, None).shape == (1, 1, 64)
    with pytest.raises(TypeError, match="attend_cached_self_kv"):
        aux_attend(ctx, 0, attn, q, (kv, kv))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("preset", "changes"), VARIANTS)
def test_cuda_prefill_and_grouped_decode_match_cpu(preset: str, changes: dict[str, Any]) -> None:
    model = dual(preset, **changes)
    gpu = dual(preset, **changes).to("cuda")
    ids = ids_for(model, 2, 9)
    out, cache = model.prefill_flows(ids[:, :4])
    got, gpu_cache = gpu.prefill_flows(ids[:, :4].cuda())
    steps = [(out, got)]
    for t in range(4, 9):
        steps.append((model.decode_flows(ids[:, t], cache),
                      gpu.decode_flows(ids[:, t].cuda(), gpu_cache)))
    for ref, on_gpu in steps:
        for a, b in zip(on_gpu, ref, strict=True):
            close(a.cpu(), b, 1e-4)
    close(gpu_cache.k.cpu(), cache.k, 1e-4)
