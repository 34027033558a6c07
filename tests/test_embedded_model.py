"""The shipped `small` checkpoint: it loads, it is trained, and `splitphase eval` scores it."""

import json

from splitphase.cli import main
from splitphase.model.checkpoint import embedded_model_names, embedded_models_dir, load_model


def test_small_ships_with_a_model_card_under_budget():
    assert "small" in embedded_model_names()
    root = embedded_models_dir()
    total = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    assert total < 40e6
    card = (root / "small" / "MODEL_CARD.md").read_text()
    assert "validation loss" in card and "training command" in card
    model = load_model("small")
    assert 8e6 < sum(p.numel() for p in model.parameters()) < 20e6


def test_eval_json_reports_a_trained_loss(data_dir, capsys):
    assert main(["eval", "--model", "small", "--max-tokens", "4096", "--data-dir", str(data_dir),
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {"model", "tokens", "loss", "continuation_loss"}
    assert doc["tokens"] >= 4000
    # Uniform guessing over 4,096 tokens costs ln(4096) = 8.3 nats; the trained model is far below.
    assert doc["loss"] < 5.0 and doc["continuation_loss"] < 5.5


def test_eval_without_prepared_data_is_a_clear_error(tmp_path, capsys):
    assert main(["eval", "--model", "small", "--data-dir", str(tmp_path)]) == 2
    assert "splitphase data prepare" in capsys.readouterr().err


def test_generate_from_embedded_model_is_text(capsys):
    assert main(["generate", "--prompt", "In the beginning", "--max-tokens", "12", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    out = doc["outputs"][0]
    assert out["finish_reason"] in ("length", "stop") and out["text"].strip()
    assert doc["summary"]["phases"]["prefill"]["prefill_tokens"] > 0
    assert doc["summary"]["dtype"] == "float32"  # the embedded checkpoint's
    # The engine flags serve has: the same greedy text from blocks of 8 without prefix caching.
    args = ["generate", "--prompt", "In the beginning", "--max-tokens", "12", "--json",
            "--temperature", "0"]
    assert main(args) == 0
    greedy = json.loads(capsys.readouterr().out)["outputs"][0]["text"]
    assert main([*args, "--block-size", "8", "--no-enable-prefix-caching", "--max-model-len",
                 "64", "--kv-cache-bytes", "4MiB"]) == 0
    assert json.loads(capsys.readouterr().out)["outputs"][0]["text"] == greedy
    assert main([*args, "--dtype", "bfloat16", "--device", "cpu"]) == 0  # as serve takes them
    bf16 = json.loads(capsys.readouterr().out)
    assert bf16["summary"]["dtype"] == "bfloat16" and bf16["outputs"][0]["text"].strip()
