"""Model geometry as one serializable dataclass, with presets as data (litgpt style).

Presets cover our own trainable models (`tiny`, `small`, `base-125m`) and the geometry of real
models the audit reasons about (no weights ship for those). Everything here is plain Python so
the FLOP/byte model and the simulator can use it without torch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from splitphase.errors import UserError

DTYPES = ("float32", "bfloat16", "float16")
ARCHS = ("baseline", "dual_flow")
COUPLINGS = ("none", "ac", "abc")
READOUTS = ("mix", "aux")
AUX_ROUTINGS = ("independent", "replay")


class ConfigError(UserError):
    """A model configuration or preset that cannot be used; the message says what to fix."""


@dataclass(frozen=True)
class ModelConfig:
    """Geometry of a Llama-style decoder (dense or MoE)."""

    name: str = "custom"
    arch: str = "baseline"
    vocab_size: int = 4096
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 4
    head_dim: int = 64
    d_ff: int = 688
    rope_theta: float = 10000.0
    # Llama-3.1 "llama3" RoPE scaling; factor 1.0 means plain RoPE.
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    max_seq_len: int = 2048
    dtype: str = "float32"
    # MoE: n_experts == 0 means a dense SwiGLU MLP in every layer.
    n_experts: int = 0
    top_k: int = 0
    n_shared_experts: int = 0
    d_expert: int = 0
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # Dual-Flow (used when arch == "dual_flow"; see shared/design/dual_flow.md).
    coupling: str = "abc"  # none | ac | abc
    readout: str = "mix"  # mix | aux
    alpha_min: float = 0.5
    aux_self_kv: bool = False
    aux_top_k: int = 0  # MoE fan-out of the auxiliary flow; 0 means equal to top_k
    aux_routing: str = "independent"  # independent | replay

    def __post_init__(self) -> None:
        positive = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim")
        for field_name in positive + ("d_ff", "max_seq_len"):
            if getattr(self, field_name) <= 0:
                raise ConfigError(f"{field_name} must be > 0, got {getattr(self, field_name)}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.arch not in ARCHS:
            raise ConfigError(f"arch must be one of {ARCHS}, got {self.arch!r}")
        if self.n_experts < 0 or self.n_shared_experts < 0:
            raise ConfigError("n_experts and n_shared_experts must be >= 0")
        if self.is_moe and not (1 <= self.top_k <= self.n_experts):
            raise ConfigError(f"top_k must be in [1, n_experts={self.n_experts}], got {self.top_k}")
        if self.is_moe and self.d_expert <= 0:
            raise ConfigError(f"d_expert must be > 0 for an MoE config, got {self.d_expert}")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ConfigError("rope_theta and norm_eps must be > 0")
        if self.rope_scaling_factor < 1.0:
            raise ConfigError(f"rope_scaling_factor must be >= 1, got {self.rope_scaling_factor}")
        bands_ok = self.rope_high_freq_factor > self.rope_low_freq_factor
        if self.rope_scaling_factor > 1.0 and not (self.rope_original_max_len > 0 and bands_ok):
            raise ConfigError(
                "llama3 RoPE scaling needs rope_original_max_len > 0 and "
                "rope_high_freq_factor > rope_low_freq_factor"
            )
        self._check_dual_flow()

    def _check_dual_flow(self) -> None:
        choices = {"coupling": COUPLINGS, "readout": READOUTS, "aux_routing": AUX_ROUTINGS}
        for field_name, allowed in choices.items():
            if getattr(self, field_name) not in allowed:
                raise ConfigError(
                    f"{field_name} must be one of {allowed}, got {getattr(self, field_name)!r}"
                )
        if not 0.0 <= self.alpha_min <= 1.0:
            raise ConfigError(f"alpha_min must be in [0, 1], got {self.alpha_min}")
        if self.aux_top_k < 0 or (self.is_moe and self.aux_top_k > self.n_experts):
            raise ConfigError(f"aux_top_k must be in [0, n_experts], got {self.aux_top_k}")

    @property
    def is_dual_flow(self) -> bool:
        return self.arch == "dual_flow"

    @property
    def aux_k(self) -> int:
        """Experts per token for the auxiliary flow (replay reuses the primary's k)."""
        if self.aux_routing == "replay":
            return self.top_k
        return self.aux_top_k or self.top_k

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def dtype_bytes(self) -> int:
        return 4 if self.dtype == "float32" else 2

    def with_(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown config fields {unknown}; known: {sorted(known)}")
        return cls(**data)

    @classmethod
    def from_name(cls, name: str) -> ModelConfig:
        """A preset by name (see `PRESETS`)."""
        key = name.lower()
        if key not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
        return cls(name=key, **PRESETS[key])

    @classmethod
    def from_hf_config(cls, path_or_dict: str | Path | dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face `config.json` (Llama, Qwen2/3, Mistral, Mixtral, Qwen3-MoE)."""
        if isinstance(path_or_dict, dict):
            hf = path_or_dict
        else:
            path = Path(path_or_dict)
            if path.is_dir():
                path = path / "config.json"
            try:
                hf = json.loads(path.read_text())
            except FileNotFoundError as exc:
                raise ConfigError(f"no config.json at {path}") from exc
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
        return _from_hf_dict(hf)


def _from_hf_dict(hf: dict[str, Any]) -> ModelConfig:
    try:
        d_model = int(hf["hidden_size"])
        n_heads = int(hf["num_attention_heads"])
        n_layers = int(hf["num_hidden_layers"])
        vocab = int(hf["vocab_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(
            f"config.json lacks a usable field {exc}; need hidden_size, num_attention_heads, "
            "num_hidden_layers and vocab_size"
        ) from exc
    n_experts = int(hf.get("num_local_experts") or hf.get("num_experts") or 0)
    d_expert = int(
        hf.get("moe_intermediate_size") or (hf.get("intermediate_size") if n_experts else 0) or 0
    )
    eos = hf.get("eos_token_id")
    model_type = str(hf.get("model_type", "llama"))
    return ModelConfig(
        name=str(hf.get("_name_or_path") or model_type),
        vocab_size=vocab,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
        head_dim=int(hf.get("head_dim") or d_model // n_heads),
        d_ff=int(hf.get("intermediate_size") or 4 * d_model),
        rope_theta=float(
            hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        ),
        **_hf_rope_scaling(hf),
        norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qk_norm=model_type.startswith("qwen3"),
        max_seq_len=int(hf.get("max_position_embeddings") or 2048),
        dtype=_hf_dtype(hf.get("torch_dtype") or hf.get("dtype")),
        n_experts=n_experts,
        top_k=int(hf.get("num_experts_per_tok") or 0) if n_experts else 0,
        n_shared_experts=int(hf.get("n_shared_experts") or 0),
        d_expert=d_expert if n_experts else 0,
        bos_token_id=hf.get("bos_token_id") if isinstance(hf.get("bos_token_id"), int) else None,
        eos_token_id=eos[0]
        if isinstance(eos, list) and eos
        else eos
        if isinstance(eos, int)
        else None,
    )


def _hf_rope_scaling(hf: dict[str, Any]) -> dict[str, Any]:
    """Our RoPE-scaling fields from `rope_scaling` (or transformers 5's `rope_parameters`)."""
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return {}
    if kind != "llama3":
        raise ConfigError(f"RoPE scaling type {kind!r} is not supported (default and llama3 are)")
    return {
        "rope_scaling_factor": float(scaling["factor"]),
        "rope_low_freq_factor": float(scaling["low_freq_factor"]),
        "rope_high_freq_factor": float(scaling["high_freq_factor"]),
        "rope_original_max_len": int(scaling["original_max_position_embeddings"]),
    }


def _hf_dtype(value: Any) -> str:
    return {"bfloat16": "bfloat16", "float16": "float16"}.get(str(value), "float32")


# Presets are data. Real-model geometries come from each model's published config.json.
OWN_PRESETS = ("tiny", "tiny-moe", "small", "base-125m")  # ours; the rest are real models'
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=512,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        d_ff=172,
        max_seq_len=256,
    ),
    "tiny-moe": dict(
        vocab_size=512,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        d_ff=172,
        max_seq_len=256,
        n_experts=4,
        top_k=2,
        n_shared_experts=1,
        d_expert=64,
    ),
    # ~9.1M parameters: sized so this model and its Dual-Flow twin (+V*D for the auxiliary
    # embedding) ship together in bf16 under the 40 MB package budget.
    "small": dict(
        vocab_size=4096,
        d_model=384,
        n_layers=5,
        n_heads=6,
        n_kv_heads=2,
        head_dim=64,
        d_ff=960,
        max_seq_len=1024,
    ),
    "base-125m": dict(
        vocab_size=32000,
        d_model=768,
        n_layers=12,
        n_heads=12,
        n_kv_heads=4,
        head_dim=64,
        d_ff=3072,
        max_seq_len=2048,
    ),
    "llama-3.2-1b": dict(
        vocab_size=128256,
        d_model=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        head_dim=64,
        d_ff=8192,
        rope_theta=500000.0,
        **{"rope_scaling_factor": 32.0, "rope_original_max_len": 8192},
        tie_embeddings=True,
        max_seq_len=131072,
        dtype="bfloat16",
    ),
    "llama-3.1-8b": dict(
        vocab_size=128256,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        d_ff=14336,
        rope_theta=500000.0,
        **{"rope_scaling_factor": 8.0, "rope_original_max_len": 8192},
        tie_embeddings=False,
        max_seq_len=131072,
        dtype="bfloat16",
    ),
    "llama-3.1-70b": dict(
        vocab_size=128256,
        d_model=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        head_dim=128,
        d_ff=28672,
        rope_theta=500000.0,
        **{"rope_scaling_factor": 8.0, "rope_original_max_len": 8192},
        tie_embeddings=False,
        max_seq_len=131072,
        dtype="bfloat16",
    ),
    "qwen3-30b-a3b": dict(
        vocab_size=151936,
        d_model=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        head_dim=128,
        d_ff=6144,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        tie_embeddings=False,
        qk_norm=True,
        max_seq_len=40960,
        dtype="bfloat16",
        n_experts=128,
        top_k=8,
        d_expert=768,
    ),
    "mixtral-8x7b": dict(
        vocab_size=32000,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        d_ff=14336,
        rope_theta=1000000.0,
        tie_embeddings=False,
        max_seq_len=32768,
        dtype="bfloat16",
        n_experts=8,
        top_k=2,
        d_expert=14336,
    ),
}
