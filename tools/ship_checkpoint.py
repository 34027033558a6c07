"""Copy a finished training run into the package as an embedded model, with its model card.

Every figure in the card comes from the run's summary.json and train_log.jsonl, and from a
fresh `evaluate` of the copied checkpoint on the held-out split, so the card says what the
shipped weights (stored in bf16) actually score.

    python tools/ship_checkpoint.py runs/small-baseline small "splitphase train ..."
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from splitphase.data.corpus import default_data_dir
from splitphase.data.shards import load_meta, load_split, load_val_boundaries
from splitphase.model.checkpoint import embedded_models_dir, load_model
from splitphase.training.evaluate import evaluate


def main(run_dir: str, name: str, command: str) -> None:
    run = Path(run_dir)
    dest = embedded_models_dir() / name
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(run / "model", dest)
    summary = json.loads((run / "summary.json").read_text())
    cfg = json.loads((dest / "config.json").read_text())
    data = default_data_dir()
    model = load_model(name)
    res = evaluate(model, load_split(data, "val"), load_val_boundaries(data), seq_len=256)
    meta = load_meta(data)
    params = sum(p.numel() for p in model.parameters())
    size_mb = (dest / "model.safetensors").stat().st_size / 1e6
    m, train_cfg = cfg["model"], cfg["training"]["config"]
    geometry = (
        f"d_model {m['d_model']}, {m['n_layers']} layers, {m['n_heads']} heads "
        f"({m['n_kv_heads']} KV heads), MLP {m['d_ff']}, vocab {m['vocab_size']}, tied embeddings"
    )
    splits = meta["splits"]
    rows = [
        ("training command", f"`{command}`"),
        ("geometry", geometry),
        (
            "data",
            f"train split {splits['train']['tokens']:,} tokens, validation split "
            f"{splits['val']['tokens']:,} tokens (held-out documents)",
        ),
        (
            "steps",
            f"{summary['steps']:,} of batch {train_cfg['batch_size']} x "
            f"{train_cfg['seq_len']} tokens ({summary['train_tokens']:,} tokens)",
        ),
        ("wall time", f"{summary['wall_s'] / 60:.1f} min on this machine's CPU"),
        (
            "validation loss (shipped weights)",
            f"{res.loss:.4f} nats/token over {res.tokens:,} tokens",
        ),
        (
            "continuation loss (shipped weights)",
            f"{res.continuation_loss:.4f} nats/token over {res.continuation_tokens:,} tokens",
        ),
    ]
    if summary.get("note"):
        rows.append(("note", summary["note"]))
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    card = f"""# {name}

A {params / 1e6:.2f}M-parameter {m["arch"]} Llama-style decoder trained from scratch on the
splitphase corpus (King James Bible + Shakespeare's plays, public domain; see
`splitphase/data/README.md`). Weights are stored in {cfg["stored_dtype"]} ({size_mb:.1f} MB)
and computed in {m["dtype"]}.

| | |
| --- | --- |
{table}

Reproduce the loss with `splitphase eval --model {name} --json` after `splitphase data prepare`.
"""
    (dest / "MODEL_CARD.md").write_text(card)
    print(card)


if __name__ == "__main__":
    main(*sys.argv[1:4])
