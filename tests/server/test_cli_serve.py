"""`splitphase serve` on the command line: user errors are one line, exit code 2."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from splitphase.cli import build_parser
from splitphase.server.config import ServerConfig, serve_policies


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "splitphase.cli", "serve", *args],
                          capture_output=True, text=True, timeout=120,
                          env={"OMP_NUM_THREADS": "1", "PATH": ""})


def _one_line(proc: subprocess.CompletedProcess[str], message: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_unknown_model_is_one_line() -> None:
    _one_line(_serve("--model", "/no/such/model", "--port", "0"), "no model")


def test_taken_port_is_one_line() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        _one_line(_serve("--port", str(s.getsockname()[1])), "cannot listen")


def test_policies_and_limits_are_validated() -> None:
    args = build_parser().parse_args(["serve"])
    assert (args.model, args.policy, args.host, args.port) == ("small", "chunked", "127.0.0.1",
                                                               8000)
    assert {"mixed", "chunked"} <= set(serve_policies())
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--policy", "fastest"])
    with pytest.raises(ValueError, match="max-queue"):
        ServerConfig(max_queue=-1)
    assert ServerConfig(api_key="k").redacted()["api_key"] == "<set>"
    assert args.health_stall_timeout == 30.0
    assert build_parser().parse_args(["serve", "--health-stall-timeout", "2"]) \
        .health_stall_timeout == 2.0
    with pytest.raises(ValueError, match="health_stall_s must be > 0"):
        ServerConfig(health_stall_s=0)


def test_disaggregated_needs_its_engine_module(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "splitphase.engine.disagg"
                        else real(name, *a))
    assert "disaggregated" not in serve_policies()
    with pytest.raises(ValueError, match="not installed"):
        ServerConfig(policy="disaggregated")


def test_the_engine_runs_in_its_own_process_unless_disaggregated() -> None:
    assert build_parser().parse_args(["serve"]).engine_process is None
    assert build_parser().parse_args(["serve", "--no-engine-process"]).engine_process is False
    assert ServerConfig().runs_engine_process
    assert not ServerConfig(engine_process=False).runs_engine_process
    assert not ServerConfig(policy="disaggregated").runs_engine_process
    with pytest.raises(ValueError, match="already runs its engines in worker processes"):
        ServerConfig(policy="disaggregated", engine_process=True)


def test_compile_flag() -> None:
    parse = build_parser().parse_args
    assert parse(["serve"]).compile is None
    assert parse(["serve", "--compile"]).compile == "prefill,decode"
    assert ServerConfig(compile=("prefill",)).engine_kwargs()["compile"] == ("prefill",)
    assert "compile" not in ServerConfig().engine_kwargs()
    _one_line(_serve("--compile", "training", "--port", "0"), "--compile takes phases among")


def test_kv_cache_dtype_flag() -> None:
    parse = build_parser().parse_args
    assert parse(["serve"]).kv_cache_dtype == "auto"
    assert parse(["serve", "--kv-cache-dtype", "bfloat16"]).kv_cache_dtype == "bfloat16"
    assert parse(["serve", "--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"
    assert ServerConfig(kv_cache_dtype="bfloat16").engine_kwargs()["kv_cache_dtype"] == "bfloat16"
    assert "kv_cache_dtype" not in ServerConfig().engine_kwargs()
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of"):
        ServerConfig(kv_cache_dtype="int8")


def test_kv_cache_bytes_takes_units_and_reaches_the_engine() -> None:
    parse = build_parser().parse_args
    assert parse(["serve"]).kv_cache_bytes is None
    for text, nbytes in (("4000000", 4_000_000), ("4G", 4 * 10**9), ("3.5GiB", 7 * 2**29),
                         ("512Mi", 2**29), ("2kB", 2000), ("4 GiB", 2**32)):
        assert parse(["serve", "--kv-cache-bytes", text]).kv_cache_bytes == nbytes, text
    assert parse(["serve", "--kv-cache-memory-bytes", "2G"]).kv_cache_bytes == 2 * 10**9  # vLLM's
    for bad in ("lots", "4Q", "G"):
        with pytest.raises(SystemExit):
            parse(["serve", "--kv-cache-bytes", bad])
    assert ServerConfig(kv_cache_bytes=2**20).engine_kwargs()["kv_cache_bytes"] == 2**20
    assert "kv_cache_bytes" not in ServerConfig().engine_kwargs()
    with pytest.raises(ValueError, match="kv-cache-bytes must be >= 1"):
        ServerConfig(kv_cache_bytes=0)


def test_engine_flags_reach_the_engine_config(monkeypatch: pytest.MonkeyPatch) -> None:
    import splitphase.commands.serve as serve_command
    from splitphase.cli import main
    from splitphase.engine.config import EngineConfig

    seen: list[ServerConfig] = []
    monkeypatch.setattr(serve_command, "serve", lambda config, *a, **k: seen.append(config))
    assert main(["serve", "--max-num-batched-tokens", "512", "--block-size", "8",
                 "--no-enable-prefix-caching", "--seed", "7", "--kv-cache-bytes", "1M",
                 "--max-model-len", "200"]) == 0
    engine = EngineConfig(**seen[0].engine_kwargs())
    assert (engine.max_num_batched_tokens, engine.block_size, engine.enable_prefix_caching,
            engine.seed, engine.kv_cache_bytes, engine.max_model_len) == (512, 8, False, 7,
                                                                          10**6, 200)
    defaults = EngineConfig(**ServerConfig().engine_kwargs())
    assert (defaults.max_num_batched_tokens, defaults.block_size,
            defaults.enable_prefix_caching) == (2048, 16, True)
    for bad in ({"block_size": 0}, {"max_num_batched_tokens": 0}):
        with pytest.raises(ValueError, match="must be >= 1"):
            ServerConfig(**bad)
    _one_line(_serve("--max-num-batched-tokens", "8", "--port", "0"),
              "max_num_batched_tokens (8) must be >= max_num_seqs (64)")
    with pytest.raises(ValueError, match="max_num_batched_tokens .8. must be >= max_num_seqs"):
        ServerConfig(policy="disaggregated", max_num_batched_tokens=8)  # before any worker
    _one_line(_serve("--max-model-len", "100000", "--port", "0"),  # from the engine process
              "max_model_len 100000 is more than the model's max_seq_len")
