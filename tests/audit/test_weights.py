"""Weight formats: bytes per weight and matmul dtype, from names and config.json files."""

from __future__ import annotations

import dataclasses

import pytest

from splitphase.audit.weights import (
    quantization_in_config,
    quantization_in_name,
    weight_format,
)
from splitphase.errors import UserError
from splitphase.hardware.specs import get_hardware


def test_formats() -> None:
    plain = weight_format(None, "bfloat16")
    assert (plain.name, plain.bytes_per_param, plain.compute_dtype) == ("bfloat16", 2, "bfloat16")
    assert not plain.quantized and weight_format(None, "float32").bytes_per_param == 4
    fp8 = weight_format("FP8", "bfloat16")
    assert (fp8.bytes_per_param, fp8.compute_dtype, fp8.quantized) == (1.0, "float8", True)
    awq = weight_format("awq", "float16")  # weight-only: the activations' dtype multiplies
    assert (awq.name, awq.bytes_per_param, awq.compute_dtype) == ("int4", 0.515625, "float16")
    assert weight_format("w8a16", "bfloat16").name == "int8"
    w8a8 = weight_format("w8a8", "bfloat16")  # int8 weights and activations: int8 matmuls
    assert (w8a8.name, w8a8.bytes_per_param, w8a8.compute_dtype) == ("w8a8_int8", 1.0, "int8")


def test_without_a_peak_for_its_matmuls_a_format_runs_weight_only() -> None:
    no_fp8 = get_hardware("a100-80gb")  # Ampere: int8 tensor cores, no fp8
    assert weight_format("fp8", "bfloat16", has_peak=no_fp8.has_peak).compute_dtype == "bfloat16"
    assert weight_format("w8a8_int8", "bfloat16", has_peak=no_fp8.has_peak).compute_dtype == "int8"
    cpu_like = dataclasses.replace(no_fp8, peak_int8_ops_per_s=None)
    weight_only = weight_format("w8a8_int8", "float16", has_peak=cpu_like.has_peak)
    assert (weight_only.bytes_per_param, weight_only.compute_dtype) == (1.0, "float16")
    with pytest.raises(UserError, match="quantization must be one of"):
        weight_format("nf4", "bfloat16")


@pytest.mark.parametrize(("config", "expected"), [
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "fp8"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "int4"),
    ({"quant_method": "gptq", "bits": 8}, "int8"),
    ({"quant_method": "gptq", "bits": 3}, None),
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "weights": {"num_bits": 8, "type": "float"}}}}, "fp8"),
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "weights": {"num_bits": 4, "type": "int"}}}}, "int4"),
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {  # W8A8 int8
        "weights": {"num_bits": 8, "type": "int"},
        "input_activations": {"num_bits": 8, "type": "int", "dynamic": True}}}}, "w8a8_int8"),
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {  # W8A16
        "weights": {"num_bits": 8, "type": "int"}, "input_activations": None}}}, "int8"),
    ({"quant_method": "compressed-tensors", "config_groups": []}, None),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, None),
    (None, None),
])
def test_quantization_in_config(config: object, expected: str | None) -> None:
    doc = {"model_type": "llama"} | ({} if config is None else {"quantization_config": config})
    assert quantization_in_config(doc) == expected


@pytest.mark.parametrize(("name", "expected"), [
    ("neuralmagic/Meta-Llama-3.1-8B-Instruct-FP8", "fp8"),
    ("hugging-quants/Meta-Llama-3.1-70B-Instruct-AWQ-INT4", "int4"),
    ("TheBloke/Mixtral-8x7B-v0.1-GPTQ", "int4"),
    ("RedHatAI/Llama-3.1-8B-Instruct-quantized.w4a16", "int4"),
    ("RedHatAI/Meta-Llama-3.1-8B-Instruct-quantized.w8a8", "w8a8_int8"),
    ("Qwen2-7B-Instruct-FP8-w8a8", "fp8"),  # the first word that names a format
    ("meta-llama/Llama-3.1-8B-Instruct", None),
    ("fp8lover/llama", None),  # a word of the name, not part of one
])
def test_quantization_in_name(name: str, expected: str | None) -> None:
    assert quantization_in_name(name) == expected
