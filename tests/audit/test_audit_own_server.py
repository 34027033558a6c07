"""`splitphase audit --target openai:` against our own `splitphase serve`: a valid report."""

from __future__ import annotations

import json
from pathlib import Path

from splitphase.audit.report.schema import validate_report
from splitphase.cli import main
from splitphase.engine.kv_cache import kv_bytes_per_block
from splitphase.model.checkpoint import read_config
from splitphase.server.process import ServerProcess


def test_audit_of_our_server_validates(tiny_ckpt: Path, tmp_path: Path) -> None:
    # The fp32 checkpoint served in bf16 over an fp32 pool of 515 kB in blocks of 8 tokens:
    # the audit learns the dtype, the pool's width and its size from /metrics (blocks of 16
    # would hold 1,008 tokens, not 1,000).
    server = ServerProcess(["--model", str(tiny_ckpt), "--hardware", "h100", "--dtype",
                            "bfloat16", "--kv-cache-dtype", "float32", "--kv-cache-bytes",
                            "515k", "--block-size", "8"], env={"OMP_NUM_THREADS": "1"})
    with server as url:  # no --model-config: the served directory is on this machine
        code = main(["audit", "--target", f"openai:{url}", "--hardware", "cpu", "--quick",
                     "--out", str(tmp_path), "--no-progress"])
        log = server.log()
    assert code == 0, log
    doc = json.loads((tmp_path / "report.json").read_text())
    validate_report(doc)
    assert doc["model"]["config"] == read_config(tiny_ckpt)[0].with_(dtype="bfloat16").to_dict()
    source = (f"served model root {str(tiny_ckpt)!r}, its config.json on this machine, "
              "computing in bfloat16 (its /metrics)")
    assert doc["target"]["model_config_source"] == source
    assert doc["target"]["server_metrics"] is True  # our splitphase:* histograms were scraped
    assert doc["target"]["kv_cache_dtype"] == "float32"
    assert doc["target"]["kv_cache_dtype_source"] == "target"
    assert doc["model"]["kv_dtype_bytes"] == 4 and doc["model"]["weight_bytes_per_param"] == 2
    blocks = 515_000 // kv_bytes_per_block(read_config(tiny_ckpt)[0], 8, 4)
    assert doc["target"]["kv_pool_tokens"] == blocks * 8 == 1000
    assert doc["target"]["max_num_seqs"] == 64 and doc["target"]["preemptions"] == 0
    assert doc["target"]["policy"] == "chunked"  # serve's default, as /metrics states it
    assert "pool 1,000 tokens, at most 64 sequences" in (tmp_path / "report.md").read_text()
