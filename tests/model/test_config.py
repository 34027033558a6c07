import json

import pytest

from splitphase.model.config import PRESETS, ConfigError, ModelConfig


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_build_and_roundtrip(name):
    cfg = ModelConfig.from_name(name)
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_real_model_names_present():
    for name in ["llama-3.2-1b", "llama-3.1-8b", "llama-3.1-70b", "qwen3-30b-a3b", "mixtral-8x7b"]:
        assert name in PRESETS


def test_unknown_preset_lists_choices():
    with pytest.raises(ConfigError, match="unknown preset 'nope'.*tiny"):
        ModelConfig.from_name("nope")


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"n_heads": 6, "n_kv_heads": 4}, "multiple"),
        ({"dtype": "int4"}, "dtype"),
        ({"n_experts": 4, "top_k": 5, "d_expert": 8}, "top_k"),
        ({"d_model": 0}, "d_model"),
        ({"coupling": "x"}, "coupling"),
    ],
)
def test_invalid_fields_name_the_field(changes, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_name("tiny").with_(**changes)


def test_unknown_field_rejected():
    with pytest.raises(ConfigError, match="unknown config fields"):
        ModelConfig.from_dict({"width": 3})


def test_from_hf_config_llama_and_moe(tmp_path):
    llama = {
        "model_type": "llama",
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 32,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "eos_token_id": [128001, 128009],
    }
    (tmp_path / "config.json").write_text(json.dumps(llama))
    cfg = ModelConfig.from_hf_config(tmp_path)
    preset = ModelConfig.from_name("llama-3.1-8b")
    for field in ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff", "vocab_size"):
        assert getattr(cfg, field) == getattr(preset, field)
    assert cfg.eos_token_id == 128001 and cfg.dtype == "bfloat16"
    moe = dict(
        llama,
        model_type="qwen3_moe",
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        head_dim=128,
    )
    cfg = ModelConfig.from_hf_config(moe)
    assert cfg.n_experts == 128 and cfg.top_k == 8 and cfg.d_expert == 768 and cfg.qk_norm


def test_from_hf_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_hf_config(tmp_path)
    with pytest.raises(ConfigError, match="hidden_size"):
        ModelConfig.from_hf_config({"model_type": "llama"})

