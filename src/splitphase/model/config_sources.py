"""Where a model's geometry comes from: a preset name, a config.json, or a served model's name.

Plain Python like config.py: the audit's openai: target, the planner and the commands use it
without torch.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from splitphase.model.config import OWN_PRESETS, PRESETS, ConfigError, ModelConfig

CONFIG_FILE = "config.json"

# Words in a served model's name for weight formats the audit does not price (its own table,
# audit/weights.py, prices FP8, INT8 W8A8, INT8/INT4 weight-only, AWQ and GPTQ).
_UNPRICED = re.compile(r"(^|[-_./])(fp4|nvfp4|mxfp4|w4a8|gguf|bnb|4bit|8bit|"
                       r"q[2-8]_k(_[sml])?|q[48]_0|exl2)($|[-_./])")


def config_doc(path: Path) -> dict[str, Any] | None:
    """The JSON object in a model directory's (or a file's) config.json, else None."""
    file = path / CONFIG_FILE if path.is_dir() else path
    try:
        doc = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


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
    `small`). A name in a weight format the audit cannot price (GGUF, bitsandbytes, FP4, ...)
    matches none; FP8, W8A8, AWQ or GPTQ keep the preset's geometry, their weights priced
    apart."""
    name = model_id.strip().rstrip("/").rsplit("/", 1)[-1].lower()
    if name in OWN_PRESETS:
        return name
    if not name or _UNPRICED.search(name):
        return None
    found = [p for p in PRESETS if p not in OWN_PRESETS
             and re.search(rf"(^|[-_.]){re.escape(p)}($|[-_.])", name)]
    return max(found, key=len, default=None)
