"""The one-call decode pass against the per-op path (bit for bit) and the torch reference."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from splitphase.engine.config import EngineConfig
from splitphase.engine.llm_engine import LLMEngine
from splitphase.engine.sampling_params import SamplingParams
from splitphase.kernels import build, decode_stack, packed_linear, skinny
from splitphase.model.attention_context import KVCache
from splitphase.model.config import ModelConfig
from splitphase.model.tokenizer import Tokenizer
from splitphase.model.transformer import Transformer

needs_kernel = pytest.mark.skipif(
    not build.available(), reason=f"native kernel unavailable: {build.status().reason}"
)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Rows of every fused call; the switches are restored afterwards."""
    seen: list[int] = []
    real = decode_stack.decode_layers

    def spy(x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        seen.append(x.shape[0])
        return real(x, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(decode_stack, "decode_layers", spy)
    yield seen
    decode_stack.set_enabled(True)
    skinny.set_enabled(True)


def _model(preset: str = "tiny", **changes: object) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig.from_name(preset).with_(**changes)).eval()


def _ids(model: Transformer, batch: int, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.cfg.vocab_size, (batch, length), generator=g)


def _decode(model: Transformer, ids: torch.Tensor) -> tuple[torch.Tensor, KVCache]:
    """Prefill 5 tokens, then decode the rest one at a time: stacked logits, the cache."""
    _, cache = model.prefill(ids[:, :5])
    steps = [model.decode_step(ids[:, t], cache) for t in range(5, ids.shape[1])]
    return torch.stack(steps), cache


@needs_kernel
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch", [1, 3, 5])
def test_fused_is_bit_identical_to_per_op(dtype: str, batch: int, calls: list[int]) -> None:
    model = _model(dtype=dtype)
    ids = _ids(model, batch, 12, seed=batch)
    fused, c1 = _decode(model, ids)
    assert calls == [batch] * 7
    decode_stack.set_enabled(False)
    per_op, c2 = _decode(model, ids)
    assert len(calls) == 7
    assert torch.equal(fused, per_op)
    assert torch.equal(c1.k, c2.k) and torch.equal(c1.v, c2.v)


@needs_kernel
def test_fused_rows_do_not_depend_on_batch(calls: list[int]) -> None:
    model = _model()
    ids = _ids(model, 4, 10, seed=1)
    alone = [_decode(model, ids[row : row + 1]) for row in range(4)]
    # The batch starts from the single rows' prefills (a batched prefill GEMM rounds apart).
    cache = model.new_cache(4, model.cfg.max_seq_len)
    for row, (_, single) in enumerate(alone):
        cache.k[:, row], cache.v[:, row] = single.k[:, 0], single.v[:, 0]
    cache.length = 5
    for t in range(5, 10):
        full = model.decode_step(ids[:, t], cache)
        for row, (steps, _) in enumerate(alone):
            assert torch.equal(steps[t - 5, 0], full[row]), (row, t)
    assert calls[-1] == 4


@needs_kernel
def test_fused_matches_torch_reference_and_greedy(calls: list[int]) -> None:
    model = _model()
    prompt = list(range(3, 40))
    fast = model.generate(prompt, 24)
    ids = torch.tensor([prompt[:12], prompt[::-1][:12]])
    fused, _ = _decode(model, ids)
    assert calls
    skinny.set_enabled(False)
    assert model.generate(prompt, 24) == fast
    ref, _ = _decode(model, ids)
    torch.testing.assert_close(fused, ref, atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("changes", [{"qk_norm": True}, {"dtype": "float16"}])
def test_models_the_pass_does_not_cover_run_per_op(changes: dict, calls: list[int]) -> None:
    model = _model(**changes)
    _decode(model, torch.randint(0, model.cfg.vocab_size, (2, 8)))
    assert calls == []


@needs_kernel
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_past_the_skinny_rows_linears_run_on_packed_weights(dtype: str, calls: list[int]) -> None:
    """Past skinny.max_rows the native pass would call torch's linear (a weight repack every
    call): oneDNN's packed copies run inside the pass, bit for bit the per-op path, the LM
    head packed too (MKL's run in the per-op path); with packing off the pass calls torch's
    linear. Each matches the torch reference."""
    model = _model(dtype=dtype)
    if packed_linear.backend_for(model.dtype) is None or not packed_linear.is_enabled():
        pytest.skip(f"this torch has no packed GEMM for {dtype}")
    rows = skinny.max_rows(model.dtype) + 1
    ids = _ids(model, rows, 7, seed=2)
    fused, c1 = _decode(model, ids)
    in_pass = packed_linear.backend_for(model.dtype) == "onednn"
    assert calls == ([rows] * 2 if in_pass else []) and model._head_packed.nbytes > 0
    with decode_stack.switched(False):
        per_op, c2 = _decode(model, ids)
    assert torch.equal(fused, per_op)
    assert torch.equal(c1.k, c2.k) and torch.equal(c1.v, c2.v)
    calls.clear()
    with packed_linear.switched(False):
        _decode(model, ids)
    assert calls == [rows] * 2
    with skinny.switched(False), packed_linear.switched(False):
        ref, _ = _decode(model, ids)
    tol = 1e-4 if dtype == "float32" else 5e-2
    torch.testing.assert_close(fused.float(), ref.float(), atol=tol, rtol=tol)


@needs_kernel
@pytest.mark.skipif("mkl" not in packed_linear.backends(), reason="this torch has no MKL GEMM")
def test_past_the_skinny_rows_mkl_packed_linears_run_per_op(calls: list[int]) -> None:
    model = _model()
    with packed_linear.using_backend("mkl"):
        rows = skinny.max_rows(model.dtype) + 1
        _decode(model, _ids(model, rows, 7, seed=2))
    assert calls == []


@needs_kernel
def test_moe_runs_per_op(calls: list[int]) -> None:
    model = _model("tiny-moe")
    _decode(model, torch.randint(0, model.cfg.vocab_size, (2, 8)))
    assert calls == []


@needs_kernel
# Narrower than fp32: bf16 and both fp8 formats (written through a byte view, read widened).
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16", "fp8_e4m3", "fp8_e5m2"])
def test_engine_decode_steps_use_it_and_match_per_op(
    tokenizer: Tokenizer, calls: list[int], kv_cache_dtype: str
) -> None:
    model = _model(vocab_size=tokenizer.vocab_size)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)
    prompts = [[0, *range(5, 5 + n)] for n in (3, 17, 9)]
    cfg = EngineConfig(policy="mixed", num_blocks=64, max_num_seqs=4,
                       kv_cache_dtype=kv_cache_dtype)
    runs = []
    for on in (True, False):
        decode_stack.set_enabled(on)
        engine = LLMEngine(model, tokenizer, cfg)
        ids = [engine.add_request(p, params) for p in prompts]
        done = {}
        with torch.inference_mode():
            while engine.has_unfinished_requests():
                done.update({o.request_id: o for o in engine.step() if o.finished})
        runs.append([(done[i].token_ids, done[i].logprobs) for i in ids])
        if on:
            assert calls and max(calls) == len(prompts)  # decode-only steps took the fused pass
    assert runs[0] == runs[1]


@needs_kernel
def test_converting_the_model_after_a_fused_pass_uses_the_new_weights(calls: list[int]) -> None:
    model = _model()
    ids = _ids(model, 2, 8, seed=3)
    _decode(model, ids)  # the fp32 weight list is built here
    model.to(torch.bfloat16)
    fused, _ = _decode(model, ids)
    assert calls[-1] == 2 and fused.dtype == torch.bfloat16
    decode_stack.set_enabled(False)
    assert torch.equal(fused, _decode(model, ids)[0])
