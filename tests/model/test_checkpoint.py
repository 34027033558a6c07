import json

import pytest
import torch

from splitphase.model.checkpoint import CheckpointError, load_model, save_checkpoint
from splitphase.model.config import ModelConfig
from splitphase.model.transformer import Transformer


def test_roundtrip_ours(tmp_path):
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name("tiny")).eval()
    save_checkpoint(model, tmp_path / "m")
    loaded = load_model(str(tmp_path / "m"))
    ids = torch.randint(0, 512, (1, 7))
    assert torch.equal(model(ids), loaded(ids))


def test_bf16_storage_keeps_fp32_compute(tmp_path):
    model = Transformer(ModelConfig.from_name("tiny")).eval()
    save_checkpoint(model, tmp_path / "m", dtype="bfloat16")
    doc = json.loads((tmp_path / "m" / "config.json").read_text())
    assert doc["stored_dtype"] == "bfloat16" and doc["model"]["dtype"] == "float32"
    assert load_model(str(tmp_path / "m")).dtype == torch.float32


def test_mismatched_checkpoint_is_a_clear_error(tmp_path):
    save_checkpoint(Transformer(ModelConfig.from_name("tiny")), tmp_path / "m")
    doc = json.loads((tmp_path / "m" / "config.json").read_text())
    doc["model"]["d_model"] = 128
    doc["model"]["head_dim"] = 32
    (tmp_path / "m" / "config.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="shape"):
        load_model(str(tmp_path / "m"))


def test_missing_path_names_embedded_models(tmp_path):
    with pytest.raises(CheckpointError, match="no model"):
        load_model(str(tmp_path / "nope"))


def _random_hf_llama(tmp_path, tie: bool, rope_scaling: dict | None = None):
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=tie,
        rope_scaling=rope_scaling,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    return hf


@pytest.mark.parametrize("tie", [False, True])
def test_hf_llama_parity(tmp_path, tie):
    hf = _random_hf_llama(tmp_path, tie)
    ours = load_model(str(tmp_path))
    assert ours.cfg.n_kv_heads == 2 and ours.cfg.tie_embeddings == tie
    ids = torch.randint(0, 300, (2, 11))
    with torch.no_grad():
        expected = hf(ids).logits
    torch.testing.assert_close(ours(ids), expected, atol=1e-4, rtol=1e-4)


def test_hf_llama3_rope_scaling_parity(tmp_path):
    # A short original context puts the test's positions in all three frequency bands.
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    hf = _random_hf_llama(tmp_path, False, scaling)
    ours = load_model(str(tmp_path))
    assert ours.cfg.rope_scaling_factor == 8.0 and ours.cfg.rope_original_max_len == 16
    ids = torch.randint(0, 300, (1, 60))
    with torch.no_grad():
        expected = hf(ids).logits
    torch.testing.assert_close(ours(ids), expected, atol=1e-4, rtol=1e-4)
    plain = Transformer(ours.cfg.with_(rope_scaling_factor=1.0)).eval()  # same weights, no scaling
    plain.load_state_dict(ours.state_dict())
    assert not torch.allclose(plain(ids), expected, atol=1e-3)  # the scaling matters here


def test_hf_unsupported_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "hidden_size": 8}))
    with pytest.raises(CheckpointError, match="not supported"):
        load_model(str(tmp_path))


def test_hf_malformed_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_model(str(tmp_path))
