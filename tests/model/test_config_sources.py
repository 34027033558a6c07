"""Where geometry comes from: presets by a served model's name, local model directories."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from splitphase.model.config import ConfigError, ModelConfig
from splitphase.model.config_sources import (
    load_model_config,
    local_model_dir,
    preset_for_model_id,
)


@pytest.mark.parametrize(("served", "preset"), [
    ("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b"),
    ("meta-llama/Meta-Llama-3.1-70B-Instruct", "llama-3.1-70b"),
    ("Qwen/Qwen3-30B-A3B-Instruct-2507", "qwen3-30b-a3b"),
    ("mistralai/Mixtral-8x7B-Instruct-v0.1", "mixtral-8x7b"),
    ("/models/llama-3.2-1b/", "llama-3.2-1b"),  # vLLM's root: a local path
    ("small", "small"),  # our server's embedded model
    ("tiny-moe", "tiny-moe"),  # the longer of two names that fit
    ("microsoft/Phi-3-small-8k-instruct", None),  # ours match only by their exact name
    ("neuralmagic/Meta-Llama-3.1-8B-Instruct-FP8", "llama-3.1-8b"),  # weights priced apart
    ("TheBloke/Mixtral-8x7B-v0.1-GPTQ", "mixtral-8x7b"),
    ("Llama-3.1-8B-Instruct-Q4_K_M.gguf", None),  # a format the audit does not price
    ("RedHatAI/Meta-Llama-3.1-8B-Instruct-quantized.w8a8", "llama-3.1-8b"),  # int8 W8A8
    ("RedHatAI/Llama-3.1-8B-Instruct-NVFP4", None),
    ("unsloth/Llama-3.2-1B-Instruct-bnb-4bit", None),
    ("llama-3.1-80b", None),
    ("gpt2", None),
    ("", None),
])
def test_preset_for_a_served_model_id(served: str, preset: str | None) -> None:
    assert preset_for_model_id(served) == preset


def test_local_model_dirs_and_config_files(tmp_path: Path) -> None:
    assert local_model_dir(str(tmp_path)) is None  # no config.json
    assert local_model_dir("meta-llama/Llama-3.1-8B-Instruct") is None  # a hub name
    assert local_model_dir("x" * 5000) is None  # longer than a path may be
    ours = ModelConfig.from_name("tiny")
    (tmp_path / "config.json").write_text(json.dumps({"format": "splitphase",
                                                      "model": ours.to_dict()}))
    assert local_model_dir(str(tmp_path)) == tmp_path
    assert load_model_config(str(tmp_path)) == ours
    assert load_model_config("llama-3.1-8b") == ModelConfig.from_name("llama-3.1-8b")
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        load_model_config(str(tmp_path))
