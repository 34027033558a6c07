"""Where a model's geometry comes from: a preset name, a config.json, or a served model's name.

Plain Python like config.py: the audit's openai: target, the planner and the commands use it
without torch.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from splitphase.model.config import OWN_PRESETS, PRESETS, ConfigError, ModelConfig

CONFIG_FILE = "config.json"

# Words in a served model's name that mean its weights are not the preset's bf16 ones.
_QUANTIZED = re.compile(r"(^|[-_./])(fp8|fp4|nvfp4|int4|int8|awq|gptq|gguf|bnb|w4a16|w8a8|w8a16|"
                        r"4bit|8bit|q[2-8]_k(_[sml])?|q[48]_0|exl2)($|[-_./])")


def load_model_config(name_or_path: str) -> ModelConfig:
    """A preset name, a Hugging Face config.json, or one of our checkpoints' config.json."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        path = path / CONFIG_FILE
    if not path.exists():
        return ModelConfig.from_name(name_or_path)
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--model-config {path} is not readable JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise ConfigError(f"--model-config {path} must hold a JSON object")
    try:
        if doc.get("format") == "splitphase":
            return ModelConfig.from_dict(doc["model"])
        return ModelConfig.from_hf_config(doc)
    except (KeyError, TypeError) as exc:
        raise ConfigError(f"--model-config {path}: unusable config ({exc})") from exc


def local_model_dir(path: str) -> Path | None:
    """`path` if it is a model directory on this machine (a config.json in it), else None:
    a server on this host that serves a local directory names it (vLLM's `root`, ours)."""
    p = Path(path).expanduser()
    try:
        return p if (p / CONFIG_FILE).is_file() else None
    except OSError:  # a name too long for a path, or one the OS refuses
        return None


def preset_for_model_id(model_id: str) -> str | None:
    """The preset a served model's id or path names (`meta-llama/Llama-3.1-8B-Instruct` ->
    `llama-3.1-8b`), else None: the longest real model's preset found in its last path
    component between separators, or one of ours by its exact name (`Phi-3-small` is not
    `small`). A quantized name (FP8, AWQ, GPTQ, ...) matches none: its weights are not the
    preset's."""
    name = model_id.strip().rstrip("/").rsplit("/", 1)[-1].lower()
    if name in OWN_PRESETS:
        return name
    if not name or _QUANTIZED.search(name):
        return None
    found = [p for p in PRESETS if p not in OWN_PRESETS
             and re.search(rf"(^|[-_.]){re.escape(p)}($|[-_.])", name)]
    return max(found, key=len, default=None)
