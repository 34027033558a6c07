"""`splitphase audit` and `compare` from the command line: bad input, and real quick runs."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from splitphase.audit.fake_server import FakeOpenAIServer, FakeTiming
from splitphase.audit.report import validate_report
from splitphase.cli import main
from splitphase.model.checkpoint import save_checkpoint
from splitphase.model.config import ModelConfig
from splitphase.model.transformer import Transformer

OPENAI_ARGS = ["--hardware", "h100", "--model-config", "llama-3.2-1b", "--no-progress"]
_LLAMA_1B_HF = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
                "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
                "intermediate_size": 8192, "max_position_embeddings": 131072,
                "torch_dtype": "bfloat16", "tie_word_embeddings": True}


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    cfg = ModelConfig.from_name("tiny").with_(vocab_size=4096)
    return save_checkpoint(Transformer(cfg), tmp_path_factory.mktemp("tiny"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fails(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_unreachable_url_is_one_line_exit_2() -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    proc = subprocess.run(
        [sys.executable, "-m", "splitphase.cli", "audit", "--target", f"openai:{url}",
         "--out", "/tmp/unused", *OPENAI_ARGS],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "cannot reach" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_non_openai_server(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with FakeOpenAIServer(FakeTiming(openai=False)) as url:
        _fails(capsys, ["audit", "--target", f"openai:{url}", "--out", str(tmp_path),
                        *OPENAI_ARGS], "not an OpenAI-compatible server")


def test_unknown_hardware(capsys: pytest.CaptureFixture[str], tiny_ckpt: Path) -> None:
    _fails(capsys, ["audit", "--target", f"builtin:{tiny_ckpt}", "--hardware", "tpu-v9",
                    "--out", "/tmp/unused"], "unknown hardware 'tpu-v9'")


def test_openai_needs_hardware_and_geometry(capsys: pytest.CaptureFixture[str]) -> None:
    with FakeOpenAIServer() as url:
        _fails(capsys, ["audit", "--target", f"openai:{url}", "--out", "/tmp/unused"],
               "need --hardware")
        _fails(capsys, ["audit", "--target", f"openai:{url}", "--hardware", "h100",
                        "--out", "/tmp/unused"], "--model-config")


def test_malformed_config_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    _fails(capsys, ["audit", "--target", "builtin:x", "--model-config", str(bad),
                    "--out", str(tmp_path)], "not readable JSON")
    bad.write_text(json.dumps({"hidden_size": 64}))
    _fails(capsys, ["audit", "--target", "builtin:x", "--model-config", str(bad),
                    "--out", str(tmp_path)], "num_attention_heads")
    _fails(capsys, ["audit", "--target", "builtin:x", "--model-config", "gpt-17",
                    "--out", str(tmp_path)], "unknown preset 'gpt-17'")


def test_zero_length_timings(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with FakeOpenAIServer(FakeTiming(burst=True)) as url:  # every response in one chunk
        _fails(capsys, ["audit", "--target", f"openai:{url}", "--quick", "--out",
                        str(tmp_path), *OPENAI_ARGS], "no inter-token gaps")


def test_bad_workload_file(capsys: pytest.CaptureFixture[str], tiny_ckpt: Path,
                           tmp_path: Path) -> None:
    work = tmp_path / "w.jsonl"
    work.write_text('{"prompt_tokens": -3, "output_tokens": 4}\n')
    _fails(capsys, ["audit", "--target", f"builtin:{tiny_ckpt}", "--hardware", "h100",
                    "--workload", str(work), "--out", str(tmp_path)], "w.jsonl:1")


def test_quick_builtin_audit_writes_a_valid_report(
    capsys: pytest.CaptureFixture[str], tiny_ckpt: Path, tmp_path: Path
) -> None:
    out = tmp_path / "report"
    assert main(["audit", "--target", f"builtin:{tiny_ckpt}", "--hardware", "cpu", "--quick",
                 "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert str(out / "report.html") in printed and "decode uses" in printed.lower()
    doc = json.loads((out / "report.json").read_text())
    validate_report(doc)
    assert doc["target"]["kind"] == "builtin" and doc["probe"]["quick"] is True
    assert doc["hardware"]["name"] == "cpu"
    assert {p["concurrency"] for p in doc["profile"]["points"]} == {1, 4}
    assert (out / "report.md").exists() and (out / "report.html").stat().st_size > 10_000
    # Our own engine is re-run under each batching policy: measured, not projected, evidence.
    policy = [o for o in doc["optimizations"] if o["name"].startswith("batching policy")]
    assert len(policy) == 1 and policy[0]["evidence"] == "measured"
    assert all(f"{p}:" in policy[0]["detail"] for p in ("mixed", "chunked", "disaggregated"))


def test_openai_audit_with_workload_file(tmp_path: Path) -> None:
    work = tmp_path / "mooncake.jsonl"
    work.write_text("".join(json.dumps({"timestamp": i, "input_length": 40 * (i + 1),
                                        "output_length": 6}) + "\n" for i in range(6)))
    # No --model-config: the served model's id names the preset, and the report says so.
    with FakeOpenAIServer(FakeTiming(model_id="meta-llama/Llama-3.2-1B-Instruct")) as url:
        assert main(["audit", "--target", f"openai:{url}", "--workload", str(work),
                     "--quick", "--price-per-hour", "2.0", "--out", str(tmp_path / "r"),
                     "--hardware", "h100", "--no-progress"]) == 0
    doc = json.loads((tmp_path / "r" / "report.json").read_text())
    validate_report(doc)
    assert doc["model"]["name"] == "llama-3.2-1b"
    named = "parameters, geometry from the served model id 'meta-llama/Llama-3.2-1B-Instruct', K/V"
    assert named in (tmp_path / "r" / "report.md").read_text()
    assert doc["profile"]["source"] == "server" and doc["cost"]["price_usd_per_hour"] == 2.0
    assert doc["probe"]["workload_file"] == str(work)
    assert doc["profile"]["interference"] is not None  # streaming targets get the probe


def test_openai_audit_prices_decode_at_the_servers_kv_cache_width(tmp_path: Path) -> None:
    docs = {}
    with FakeOpenAIServer(FakeTiming(cache_dtype="fp8")) as url:
        for name, extra in (("stated", []), ("declared", ["--kv-cache-dtype", "bfloat16"])):
            assert main(["audit", "--target", f"openai:{url}", "--quick",
                         "--out", str(tmp_path / name), *OPENAI_ARGS, *extra]) == 0
            docs[name] = json.loads((tmp_path / name / "report.json").read_text())
            validate_report(docs[name])
    stated, declared = docs["stated"], docs["declared"]
    assert stated["target"]["kv_cache_dtype"] == "fp8"
    assert stated["target"]["kv_cache_dtype_source"] == "target"
    assert declared["target"]["kv_cache_dtype"] == "bfloat16"
    assert declared["target"]["kv_cache_dtype_source"] == "option"  # the option wins
    assert stated["model"]["kv_dtype_bytes"] == 1 and declared["model"]["kv_dtype_bytes"] == 2
    assert 2 * stated["model"]["kv_bytes_per_token"] == declared["model"]["kv_bytes_per_token"]
    assert "K/V cache fp8 (1 byte/element)" in (tmp_path / "stated" / "report.md").read_text()
    assert "K/V cache fp8" in (tmp_path / "stated" / "report.html").read_text()
    kv_rows = {n: next(o for o in d["optimizations"] if o["name"] == "narrower K/V cache")
               for n, d in docs.items()}
    assert not kv_rows["stated"]["applicable"] and kv_rows["declared"]["applicable"]


def test_preemptions_during_the_probe_are_a_warning(tmp_path: Path) -> None:
    docs = {}
    for name, per_request in (("preempting", 1), ("quiet", 0)):
        with FakeOpenAIServer(FakeTiming(preemptions_per_request=per_request)) as url:
            assert main(["audit", "--target", f"openai:{url}", "--quick",
                         "--out", str(tmp_path / name), *OPENAI_ARGS]) == 0
        docs[name] = json.loads((tmp_path / name / "report.json").read_text())
        validate_report(docs[name])
    assert docs["preempting"]["target"]["preemptions"] > 0 and docs["quiet"]["target"][
        "preemptions"] == 0
    warned = [w for w in docs["preempting"]["warnings"] if "preempted requests" in w]
    assert warned and f"{docs['preempting']['target']['preemptions']} times" in warned[0]
    assert not any("preempted" in w for w in docs["quiet"]["warnings"])
    assert "K/V pool ran out" in (tmp_path / "preempting" / "report.md").read_text()


def test_a_cache_dtype_the_audit_cannot_price_falls_back_to_the_model(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with FakeOpenAIServer(FakeTiming(cache_dtype="int4")) as url:
        args = ["audit", "--target", f"openai:{url}", "--quick", "--out", str(tmp_path),
                *OPENAI_ARGS]
        assert main([a for a in args if a != "--no-progress"]) == 0
    assert "states K/V cache dtype 'int4', which the audit cannot price" in capsys.readouterr().out
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["target"]["kv_cache_dtype"] == "auto"
    assert doc["target"]["kv_cache_dtype_source"] == "model"
    assert doc["model"]["kv_dtype_bytes"] == ModelConfig.from_name("llama-3.2-1b").dtype_bytes


def test_hf_audit_refuses_a_kv_cache_dtype(capsys: pytest.CaptureFixture[str],
                                           tmp_path: Path) -> None:
    _fails(capsys, ["audit", "--target", f"hf:{tmp_path}", "--kv-cache-dtype", "fp8",
                    "--out", str(tmp_path / "r"), "--no-progress"], "hf: target keeps K/V")


def test_compare_two_servers(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    slow = FakeTiming(prefill_s_per_token=1e-4, itl_s=0.006, cache_dtype="auto")
    fast = FakeTiming(prefill_s_per_token=2e-5, itl_s=0.003, cache_dtype="fp8",
                      model_id="org/model-FP8")  # its name states FP8 weights
    with FakeOpenAIServer(slow) as a, FakeOpenAIServer(fast) as b:
        assert main(["compare", f"openai:{a}", f"openai:{b}", "--quick", "--no-progress",
                     "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "prefill" in printed and "faster" in printed
    doc = json.loads((tmp_path / "compare.json").read_text())
    base, other = doc["targets"]
    assert other["prefill_tokens_per_s"] > base["prefill_tokens_per_s"]
    assert other["decode_tokens_per_s"] > base["decode_tokens_per_s"]
    assert (base["kv_cache_dtype"], other["kv_cache_dtype"]) == ("auto", "fp8")
    assert doc["verdicts"][0].endswith("(K/V cache fp8 vs auto)")  # decode reads fewer bytes
    assert (base["weights"], other["weights"]) == (None, "fp8")  # one states none
    assert "| K/V cache | weights |" in (tmp_path / "compare.md").read_text()
    assert 'src="data:image/png;base64,' in (tmp_path / "compare.html").read_text()


def test_openai_audit_prices_quantized_weights(tmp_path: Path) -> None:
    # An FP8 checkpoint served by name: the preset's geometry, FP8 weights (half the decode
    # bytes, FP8 matmuls on an H100; weight-only on an A100, which has no FP8 tensor cores).
    served = "neuralmagic/Meta-Llama-3.1-8B-Instruct-FP8"
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**_LLAMA_1B_HF, "quantization_config": {
        "quant_method": "awq", "bits": 4}}))
    docs = {}
    # 0.5 ms a token: an 8B model's FP8 weights take 2.4 ms to read on an H100, so the "too
    # fast" warning below holds on a slow host too (the default 2 ms left a 20% margin, which
    # the client's own overhead on a shared CPU could take).
    with FakeOpenAIServer(FakeTiming(model_id=served, itl_s=0.0005)) as url:
        runs = {"stated": ["--hardware", "h100"], "a100": ["--hardware", "a100"],
                "none": ["--hardware", "h100", "--quantization", "none"],
                "file": ["--hardware", "h100", "--model-config", str(config)],
                "w8a8": ["--hardware", "a100", "--quantization", "w8a8_int8"]}
        for name, extra in runs.items():
            assert main(["audit", "--target", f"openai:{url}", "--quick", "--no-progress",
                         "--out", str(tmp_path / name), *extra]) == 0
            docs[name] = json.loads((tmp_path / name / "report.json").read_text())
            validate_report(docs[name])
    stated = docs["stated"]
    assert stated["model"]["name"] == "llama-3.1-8b"
    assert (stated["target"]["quantization"], stated["target"]["quantization_source"]) == (
        "fp8", "target")
    assert stated["model"]["weight_bytes_per_param"] == 1 and stated["hardware"]["dtype"] == (
        "float8")
    assert "weights fp8 (1 byte each)" in (tmp_path / "stated" / "report.md").read_text()
    assert docs["a100"]["hardware"]["dtype"] == "bfloat16"
    assert docs["a100"]["model"]["weight_format"] == "fp8"
    none = docs["none"]
    assert none["target"]["quantization"] is None and none["model"]["weight_bytes_per_param"] == 2
    assert none["target"]["quantization_source"] == "option"
    # The fake server streams faster than an 8B model could on an H100: the warning names the
    # geometry's source, and (where no format was stated or chosen) the option to state one.
    too_fast = "the geometry taken from the served model id " + repr(served)
    assert any(too_fast in w and "--quantization" not in w for w in stated["warnings"])
    assert all("--quantization" not in w for w in none["warnings"])
    assert docs["file"]["target"]["quantization"] == "int4"  # --model-config's file wins
    assert docs["file"]["target"]["quantization_source"] == "model-config"
    # Int8 weights and activations: the A100 has int8 tensor cores, at twice its bf16 peak.
    w8a8 = docs["w8a8"]
    assert (w8a8["target"]["quantization"], w8a8["hardware"]["dtype"]) == ("w8a8_int8", "int8")
    assert w8a8["model"]["weight_bytes_per_param"] == 1


def test_quantization_is_for_openai_targets(capsys: pytest.CaptureFixture[str],
                                            tiny_ckpt: Path) -> None:
    _fails(capsys, ["audit", "--target", f"builtin:{tiny_ckpt}", "--quantization", "fp8",
                    "--out", "/tmp/unused"], "--quantization describes an openai: target")
