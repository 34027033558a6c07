"""The Dual-Flow benches (issue 8): their --quick modes run, write every field, print tables."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from splitphase.audit.flops import decode_flops
from splitphase.model.config import ModelConfig

ROOT = Path(__file__).resolve().parents[2]
QUALITY_ROWS = ["baseline", "dual-flow", "baseline-deeper", "moe-k1=1-k2=2-independent",
                "moe-k1=1-replay"]


def _run(script: str, *args: str, timeout: float) -> str:
    """stdout of `python bench/<script> --quick ARGS` on one thread; fails on a non-zero exit."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--quick", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def _load_bench(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def test_cost_quick_writes_every_field(tmp_path: Path) -> None:
    out = tmp_path / "cost.json"
    stdout = _run("dual_flow_cost.py", "--out", str(out), timeout=90)
    doc = json.loads(out.read_text())
    assert [d["dtype"] for d in doc["dtypes"]] == ["float32", "bfloat16"]
    for res in doc["dtypes"]:
        assert [d["batch"] for d in res["decode"]] == [1, 8]
        for d in [*res["decode"], res["prefill"]]:
            assert set(d["median_s"]) >= {"off"} and all(t > 0 for t in d["median_s"].values())
            for key in ("decode_flops", "decode_bytes", "prefill_flops", "prefill_bytes"):
                assert d[f"{key}_baseline"] > 0 and d[f"{key}_dual_flow"] > 0
        assert set(res["decode"][0]["median_s"]) == {"baseline", "off", "grouped", "separate"}
        assert set(res["prefill"]["median_s"]) == {"baseline", "off", "on"}
        assert res["kv"]["exactly_equal"] is True
    replay = [r for r in doc["moe_formula"] if r["routing"].startswith("replay")]
    assert replay and all(r["extra_expert_bytes"] == 0 for r in replay)
    assert len(doc["table"]) == 2 * (2 * 3 + 2) + len(doc["moe_formula"])
    assert "comparison (Dual-Flow / reference)" in stdout and "exactly equal" in stdout


def test_quality_quick_writes_every_field_and_resumes(data_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "quality.json"
    args = ("--data-dir", str(data_dir), "--out", str(out), "--work-dir", str(tmp_path / "runs"),
            "--seeds", "2", "--markdown", "--rows", *QUALITY_ROWS)
    stdout = _run("dual_flow_quality.py", *args, timeout=150)
    doc = json.loads(out.read_text())
    assert list(doc["rows"]) == QUALITY_ROWS and doc["settings"]["preset"] == "tiny"
    for entry in doc["rows"].values():
        assert set(entry["seeds"]) == {"0", "1"}
        for res in entry["seeds"].values():
            assert res["loss"] > 0 and res["continuation_loss"] > 0 and res["tokens"] >= 1000
        s = entry["summary"]
        assert s["n"] == 2 and s["loss_std"] is not None and s["continuation_loss_std"] is not None
        assert set(entry["cost"]) == {"params", "prefill_flops_per_token", "decode_flops_per_token",
                                      "decode_bytes_per_step", "kv_bytes_per_token",
                                      "train_flops", "train_tokens"}
    assert set(doc["verdict"]) == {"baseline", "baseline-deeper"}
    assert set(doc["geometry"]) == {"base", "matched", "moe", "training"}
    assert "| row | # | val NLL | cont. NLL |" in stdout
    assert stdout.strip().splitlines()[-1].startswith("VERDICT: Dual-Flow beats the baseline")
    again = _run("dual_flow_quality.py", *args, timeout=60)
    assert again.count("skipped") == len(QUALITY_ROWS) and "seed 0:" not in again
    assert json.loads(out.read_text())["rows"] == doc["rows"]


def test_quality_rows_cover_the_issue() -> None:
    q = _load_bench("dual_flow_quality")
    small = ModelConfig.from_name("small")
    rows = {r.name: r for r in q.build_rows(small, 100, 512, "deeper")}
    assert len(rows) == 16 and rows["baseline-2x-tokens"].steps == 200
    df, deep = rows["dual-flow"].cfg, rows["baseline-deeper"].cfg
    assert deep.arch == "baseline" and deep.n_layers > small.n_layers
    assert abs(decode_flops(deep, [512]) / decode_flops(df, [512]) - 1) < 0.005
    assert rows["dual-flow-coupling=none"].cfg.coupling == "none"
    assert rows["dual-flow-readout=aux"].cfg.readout == "aux"
    moe = [r.cfg for name, r in rows.items() if name.startswith("moe-")]
    assert len(moe) == 10 and len({(c.n_experts, c.d_expert, c.n_shared_experts) for c in moe}) == 1
    for k1 in (1, 2):
        assert rows[f"moe-k1={k1}-replay"].cfg.aux_k == k1
        assert [rows[f"moe-k1={k1}-k2={k2}-independent"].cfg.aux_k for k2 in (1, 2, 4)] == [1, 2, 4]
    with pytest.raises(SystemExit, match="matches no row"):
        q.select_rows(list(rows.values()), ["nope"])
