"""Save and load models: ours (safetensors + config.json) and local Hugging Face Llama-family dirs.

A model name resolves in this order: an embedded checkpoint shipped in the package
(`splitphase/assets/models/NAME`), then a filesystem path. Nothing is ever downloaded.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from splitphase.errors import UserError
from splitphase.model.config import ConfigError, ModelConfig
from splitphase.model.dual_flow import DualFlowTransformer
from splitphase.model.tokenizer import Tokenizer
from splitphase.model.transformer import TORCH_DTYPES, Transformer

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
SPLITPHASE_FORMAT = "splitphase"


class CheckpointError(UserError):
    """A checkpoint that cannot be found or does not match its config."""


def embedded_models_dir() -> Path:
    """Folder of the checkpoints that ship inside the package."""
    return Path(str(resources.files("splitphase") / "assets" / "models"))


def embedded_model_names() -> list[str]:
    root = embedded_models_dir()
    return (
        sorted(p.name for p in root.iterdir() if (p / CONFIG_FILE).exists())
        if root.is_dir()
        else []
    )


def resolve_model_dir(name_or_path: str) -> Path:
    """The directory of an embedded model name or a local checkpoint path."""
    embedded = embedded_models_dir() / name_or_path
    if (embedded / CONFIG_FILE).exists():
        return embedded
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / CONFIG_FILE).exists():
        return path
    known = ", ".join(embedded_model_names()) or "none"
    if path.exists():
        raise CheckpointError(f"{path} has no {CONFIG_FILE}; expected a model directory")
    raise CheckpointError(
        f"no model {name_or_path!r}: not an embedded model (embedded: {known}) nor a directory"
    )


def save_checkpoint(
    model: Transformer, out_dir: str | Path, dtype: str | None = None, extra: dict | None = None
) -> Path:
    """Write model.safetensors and config.json (our format).

    `dtype` is the storage dtype of the weights (bf16 halves the package size); the config keeps
    the compute dtype, and loading casts the stored weights to it.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stored = dtype or model.cfg.dtype
    tensors = {
        k: v.detach().to(TORCH_DTYPES[stored]).contiguous() for k, v in model.state_dict().items()
    }
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": SPLITPHASE_FORMAT})
    doc = {
        "format": SPLITPHASE_FORMAT,
        "stored_dtype": stored,
        "model": model.cfg.to_dict(),
        **(extra or {}),
    }
    (out / CONFIG_FILE).write_text(json.dumps(doc, indent=2) + "\n")
    return out


def read_config(model_dir: Path) -> tuple[ModelConfig, bool]:
    """(config, is_hf) for a model directory."""
    try:
        doc = json.loads((model_dir / CONFIG_FILE).read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{model_dir / CONFIG_FILE} is not valid JSON: {exc}") from exc
    try:
        if doc.get("format") == SPLITPHASE_FORMAT:
            return ModelConfig.from_dict(doc["model"]), False
        _check_hf_supported(doc)
        return ModelConfig.from_hf_config(doc), True
    except ConfigError as exc:
        raise CheckpointError(f"{model_dir / CONFIG_FILE}: {exc}") from exc


def _check_hf_supported(doc: dict) -> None:
    arch = doc.get("architectures") or ["?"]
    if doc.get("model_type") not in ("llama", "mistral", "qwen2", "qwen3"):
        raise CheckpointError(
            f"model_type {doc.get('model_type')!r} ({arch[0]}) is not supported; "
            "supported: llama, mistral, qwen2, qwen3 (dense)"
        )
    if doc.get("attention_bias") or doc.get("mlp_bias"):
        raise CheckpointError("checkpoints with attention or MLP biases are not supported")


def _read_hf_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def _hf_to_ours(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in tensors.items():
        name = key.removeprefix("model.")
        if name.endswith("rotary_emb.inv_freq") or (
            name == "lm_head.weight" and cfg.tie_embeddings
        ):
            continue  # recomputed / shared with the embedding
        out[name] = value
    return out


def load_model(
    name_or_path: str, device: str | torch.device = "cpu", dtype: str | None = None
) -> Transformer:
    """Load an embedded model, one of our checkpoints, or a local HF Llama-family directory."""
    model_dir = resolve_model_dir(name_or_path)
    cfg, is_hf = read_config(model_dir)
    if dtype is not None:
        cfg = cfg.with_(dtype=dtype)
    if is_hf:
        state = _hf_to_ours(_read_hf_weights(model_dir), cfg)
    else:
        weights = model_dir / WEIGHTS_FILE
        if not weights.exists():
            raise CheckpointError(f"{weights} is missing")
        state = load_file(str(weights))
    model = build_model(cfg)
    _load_state(model, state, model_dir)
    return model.to(device).eval()


def build_model(cfg: ModelConfig) -> Transformer:
    """An untrained model for a config: baseline or Dual-Flow."""
    if cfg.is_dual_flow:
        return DualFlowTransformer(cfg)
    return Transformer(cfg)


def _load_state(model: Transformer, state: dict[str, torch.Tensor], model_dir: Path) -> None:
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {model_dir} does not match its config: missing {missing[:4]}"
            f"{'...' if len(missing) > 4 else ''}, unexpected {unexpected[:4]}"
            f"{'...' if len(unexpected) > 4 else ''}"
        )
    for key, value in state.items():
        if value.shape != expected[key].shape:
            raise CheckpointError(
                f"checkpoint {model_dir}: {key} has shape {tuple(value.shape)}, "
                f"config expects {tuple(expected[key].shape)}"
            )
    dtype = model.dtype
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()})


def load_tokenizer(name_or_path: str, tokenizer_dir: str | None = None) -> Tokenizer:
    """The tokenizer of `tokenizer_dir` (or of the model's directory), else the shipped one."""
    path = Path(tokenizer_dir) if tokenizer_dir is not None else resolve_model_dir(name_or_path)
    if (path / "tokenizer_config.json").exists():
        return Tokenizer.from_pretrained_dir(path)  # keeps a non-default bos/eos
    if (path / "tokenizer.json").exists():
        return Tokenizer.from_file(path / "tokenizer.json")
    return Tokenizer.default()
