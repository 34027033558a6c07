"""The transformers baseline is the same network as ours, on the same device, and times."""

from __future__ import annotations

import pytest
import torch

from splitphase.model.config import ModelConfig
from splitphase.model.transformer import Transformer
from splitphase.perf.hf_baseline import hf_llama, time_hf

pytest.importorskip("transformers")


def _model(device: str = "cpu", dtype: str = "float32") -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig.from_name("tiny").with_(dtype=dtype)).to(device).eval()


def test_the_baseline_computes_our_logits() -> None:
    model = _model()
    hf = hf_llama(model)
    ids = torch.randint(0, model.cfg.vocab_size, (1, 12))
    ours, _ = model.prefill(ids)
    with torch.inference_mode():
        theirs = hf(input_ids=ids).logits
    torch.testing.assert_close(theirs[:, -1], ours.reshape(theirs[:, -1].shape),
                               atol=1e-4, rtol=1e-4)


def test_time_hf_reports_a_step_and_a_prefill() -> None:
    model = _model()
    t = time_hf(hf_llama(model), model.cfg.vocab_size, 8, 3, 16, 1)
    assert t["decode_step_s_b1"] > 0 and t["prefill_s"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_baseline_runs_on_the_models_gpu_in_its_dtype() -> None:
    model = _model("cuda", "bfloat16")
    hf = hf_llama(model)
    p = next(hf.parameters())
    assert p.device.type == "cuda" and p.dtype == torch.bfloat16
    t = time_hf(hf, model.cfg.vocab_size, 8, 3, 16, 1)
    assert t["decode_step_s_b1"] > 0 and t["prefill_s"] > 0
