import pytest
import torch

from splitphase.model.config import ModelConfig
from splitphase.model.transformer import Transformer, draw


@pytest.fixture(params=["tiny", "tiny-moe"])
def model(request):
    torch.manual_seed(0)
    return Transformer(ModelConfig.from_name(request.param)).eval()


def test_forward_shape(model):
    ids = torch.randint(0, model.cfg.vocab_size, (2, 9))
    assert model(ids).shape == (2, 9, model.cfg.vocab_size)


def test_prefill_then_decode_equals_full_forward(model):
    ids = torch.randint(0, model.cfg.vocab_size, (2, 16))
    full = model(ids)
    logits, cache = model.prefill(ids[:, :5])
    steps = [logits]
    for t in range(5, 16):
        steps.append(model.decode_step(ids[:, t], cache))
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 4:], atol=1e-5, rtol=1e-5)
    assert cache.length == 16


def test_chunked_prefill_equals_one_prefill(model):
    ids = torch.randint(0, model.cfg.vocab_size, (1, 12))
    one, _ = model.prefill(ids)
    cache = model.new_cache(1, 32)
    model.prefill(ids[:, :7], cache)
    two, _ = model.prefill(ids[:, 7:], cache)
    torch.testing.assert_close(one, two, atol=1e-5, rtol=1e-5)


def test_cache_overflow_is_a_clear_error(model):
    cache = model.new_cache(1, 4)
    with pytest.raises(ValueError, match="KV cache holds 4 tokens"):
        model.prefill(torch.zeros(1, 5, dtype=torch.long), cache)


def test_generate_greedy_is_argmax_of_full_forward(model):
    prompt = [1, 2, 3, 4]
    out = model.generate(prompt, max_new_tokens=6)
    seq = list(prompt)
    for _ in range(6):
        seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert out == seq[len(prompt) :]


def test_generate_seeded_sampling_is_reproducible(model):
    a = model.generate([5, 6], max_new_tokens=8, temperature=1.0, seed=3)
    b = model.generate([5, 6], max_new_tokens=8, temperature=1.0, seed=3)
    assert a == b and len(a) == 8


def test_generate_stops_at_eos(model):
    first = model.generate([1, 2], max_new_tokens=1)[0]
    assert model.generate([1, 2], max_new_tokens=10, eos_token_id=first) == [first]


def test_bf16_model_runs():
    cfg = ModelConfig.from_name("tiny").with_(dtype="bfloat16")
    m = Transformer(cfg).eval()
    logits, _ = m.prefill(torch.randint(0, cfg.vocab_size, (1, 6)))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _prefill_then_decode(model: Transformer, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Last-position logits of a prefill and of `steps` greedy decode steps after it (fp32)."""
    logits, cache = model.prefill(ids.to(model.device))
    out = [logits.float().cpu()]
    for _ in range(steps):
        logits = model.decode_step(out[-1].argmax(-1).to(model.device), cache)
        out.append(logits.float().cpu())
    return out


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize(("dtype", "tol"), [("float32", 1e-4), ("bfloat16", 3e-2)])
def test_cuda_prefill_and_decode_match_cpu_fp32(dtype: str, tol: float):
    """The same weights on the GPU: fp32 within rounding, bf16 within bf16's (on this CPU bf16
    against fp32 differs by ~4e-3 on logits of ~1)."""
    torch.manual_seed(0)
    cfg = ModelConfig.from_name("tiny")
    cpu = Transformer(cfg).eval()
    gpu = Transformer(cfg.with_(dtype=dtype)).eval()
    gpu.load_state_dict(cpu.state_dict())
    gpu = gpu.to("cuda")
    assert gpu.device.type == "cuda" and gpu.dtype == getattr(torch, dtype)
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    # Both follow the CPU's greedy tokens, so a near-tie cannot send them down different paths.
    ref = _prefill_then_decode(cpu, ids, 4)
    logits, cache = gpu.prefill(ids.cuda())
    got = [logits.float().cpu()]
    for r in ref[:-1]:
        got.append(gpu.decode_step(r.argmax(-1).cuda(), cache).float().cpu())
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def test_draw_follows_the_weights_and_never_picks_a_zero_weight():
    """The inverse-CDF draw: frequencies match the distribution (10,000 draws, a fixed seed:
    each within 4 standard deviations), zero weights are never drawn, unnormalised weights
    are the same distribution, and weights with no positive finite sum raise."""
    probs = torch.tensor([0.0, 0.1, 0.0, 0.2, 0.3, 0.4, 0.0])
    gen = torch.Generator().manual_seed(0)
    n = 10_000
    counts = torch.bincount(torch.tensor([draw(probs, gen) for _ in range(n)]), minlength=7)
    assert counts[probs == 0].sum() == 0
    sd = (n * probs * (1 - probs)).sqrt()
    assert ((counts - n * probs).abs() <= 4 * sd + 1e-9).all(), counts
    gen_a, gen_b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert [draw(probs, gen_a) for _ in range(50)] == [draw(probs * 7.5, gen_b) for _ in range(50)]
    assert draw(torch.tensor([0.0, 0.0, 1e-30]), gen) == 2
    for bad in ([0.0, 0.0], [float("nan"), 1.0], [float("inf"), 1.0]):
        with pytest.raises(ValueError, match="cannot sample"):
            draw(torch.tensor(bad), gen)
