import json
import subprocess
import sys

import pytest

from splitphase.cli import main


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "splitphase.cli", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "--model", "no-such-model", "--prompt", "hi"], "no model 'no-such-model'"),
        (["train", "--preset", "huge", "--out", "/tmp/x"], "unknown preset 'huge'"),
        (["eval", "--model", "/nonexistent/dir"], "no model"),
        (["generate", "--prompt", "hi", "--max-tokens", "0"], "--max-tokens must be >= 1"),
        (["generate", "--prompt", "hi", "--max-num-batched-tokens", "8"],
         "max_num_batched_tokens (8) must be >= max_num_seqs (64)"),
    ],
)
def test_user_errors_are_one_line_exit_2(args, message):
    proc = _run(*args)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_mismatched_checkpoint_is_exit_2(tmp_path, capsys):
    (tmp_path / "config.json").write_text(
        json.dumps({"format": "splitphase", "model": {"d_model": -1}})
    )
    assert main(["generate", "--model", str(tmp_path), "--prompt", "x"]) == 2
    assert "d_model must be > 0" in capsys.readouterr().err
