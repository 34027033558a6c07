"""How a served model stores its weights: bytes per weight and the dtype its matmuls run in.

A quantized checkpoint (an FP8 or AWQ Llama on vLLM) has the geometry of its preset, but decode
reads a half or a quarter of the bytes, and FP8's matmuls run at the FP8 peak. The audit prices
weights with a `WeightFormat`: the model's own dtype by default, or one of `QUANTIZATIONS`,
named by `--quantization`, by the checkpoint's `quantization_config`, or by the served name.
Plain Python (no torch).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from splitphase.errors import UserError


@dataclass(frozen=True)
class WeightFormat:
    """Bytes per weight (scales included) and the dtype whose peak FLOP/s the matmuls get."""

    name: str  # a model dtype (bfloat16, ...) or a quantization (fp8, w8a8_int8, int8, int4)
    bytes_per_param: float
    compute_dtype: str

    @property
    def quantized(self) -> bool:
        return self.name in QUANTIZATIONS


# fp8: vLLM's `--quantization fp8` (W8A8: FP8 weights and activations, FP8 matmuls). w8a8_int8
# (SGLang's name; compressed-tensors checkpoints with int8 weights and activations): int8
# matmuls. int8 and int4 are weight-only (W8A16, W4A16: AWQ, GPTQ, Marlin kernels): the matmuls
# run in the activations' dtype. int4 counts one 16-bit scale per group of 128 weights (4.125
# bits).
QUANTIZATIONS: dict[str, tuple[float, str | None]] = {
    "fp8": (1.0, "float8"),
    "w8a8_int8": (1.0, "int8"),
    "int8": (1.0, None),
    "int4": (4.125 / 8, None),
}
ALIASES = {"awq": "int4", "gptq": "int4", "w4a16": "int4", "w8a16": "int8", "fbgemm_fp8": "fp8",
           "w8a8_fp8": "fp8",  # SGLang's name for vLLM's fp8
           "w8a8": "w8a8_int8"}  # as the served names say it (`...-quantized.w8a8`)
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def weight_format(quantization: str | None, model_dtype: str,
                  has_peak: Callable[[str], bool] = lambda dtype: True) -> WeightFormat:
    """The format of `quantization` (None: the model's dtype, unquantized). Where the hardware
    has no peak for its matmuls' dtype (`has_peak`: FP8 on an A100, int8 on a CPU), the weights
    run weight-only, in the model's dtype, as vLLM runs FP8 on an A100."""
    if quantization is None:
        return WeightFormat(model_dtype, _DTYPE_BYTES.get(model_dtype, 2), model_dtype)
    name = ALIASES.get(quantization.lower(), quantization.lower())
    if name not in QUANTIZATIONS:
        choices = ", ".join([*QUANTIZATIONS, *ALIASES])
        raise UserError(f"quantization must be one of {choices}, got {quantization!r}")
    bytes_per_param, compute = QUANTIZATIONS[name]
    if compute is not None and not has_peak(compute):
        compute = None
    return WeightFormat(name, bytes_per_param, compute or model_dtype)


def quantization_in_config(doc: dict[str, Any]) -> str | None:
    """The quantization a Hugging Face config.json states (`quantization_config`), if one we
    price: fp8, AWQ/GPTQ at 4 or 8 bits, compressed-tensors with float or integer weights."""
    q = doc.get("quantization_config")
    if not isinstance(q, dict):
        return None
    method = str(q.get("quant_method", "")).lower()
    if method in ("fp8", "fbgemm_fp8"):
        return "fp8"
    if method in ("awq", "gptq"):
        bits = q.get("bits", 4)
        return "int4" if bits == 4 else "int8" if bits == 8 else None
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    return None


def _compressed_tensors(q: dict[str, Any]) -> str | None:
    groups = q.get("config_groups")
    group: Any = next(iter(groups.values()), None) if isinstance(groups, dict) else None
    weights = group.get("weights") if isinstance(group, dict) else None
    if not isinstance(weights, dict):
        return None
    bits, kind = weights.get("num_bits"), weights.get("type")
    if bits == 8 and kind == "float":
        return "fp8"
    if kind == "int" and bits == 8 and _int8_activations(group):
        return "w8a8_int8"
    if kind == "int" and bits in (4, 8):
        return "int4" if bits == 4 else "int8"
    return None


def _int8_activations(group: dict[str, Any]) -> bool:
    acts = group.get("input_activations")
    return isinstance(acts, dict) and acts.get("type") == "int" and acts.get("num_bits") == 8


_NAME_WORDS = re.compile(
    r"(?:^|[-_./])(w8a8_fp8|w8a8_int8|w8a8|fp8|int8|int4|awq|gptq|w4a16|w8a16)(?=$|[-_./])")


def quantization_in_name(name: str) -> str | None:
    """The quantization a served model's name states (`...-Instruct-FP8`, `...-AWQ`), if one we
    price; None for a plain name (or one whose format we do not price: see config_sources)."""
    found = _NAME_WORDS.search(name.lower())
    return None if found is None else ALIASES.get(found.group(1), found.group(1))
