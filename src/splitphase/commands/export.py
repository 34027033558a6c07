"""`splitphase export-gguf`: write a model as a GGUF file for llama.cpp."""

from __future__ import annotations

from pathlib import Path

from splitphase.model.checkpoint import load_model, load_tokenizer
from splitphase.model.config import ModelConfig
from splitphase.model.gguf_export import export_gguf
from splitphase.model.tokenizer import Tokenizer
from splitphase.model.transformer import Transformer


def export_gguf_command(model: str, out: str, dtype: str | None, preset: str | None) -> None:
    """Export an embedded model, a checkpoint, or a randomly initialised preset to GGUF."""
    tok: Tokenizer | None
    if preset is not None:
        import torch

        torch.manual_seed(0)
        cfg = ModelConfig.from_name(preset)
        net = Transformer(cfg.with_(dtype=dtype) if dtype else cfg).eval()
        shipped = load_tokenizer("small")
        tok = shipped if shipped.vocab_size <= cfg.vocab_size else None
        if tok is None:
            print(f"note: {preset} has {cfg.vocab_size} ids, fewer than the shipped tokenizer; "
                  "writing placeholder token texts")
    else:
        net = load_model(model, dtype=dtype)
        tok = load_tokenizer(model)
    path = export_gguf(net, tok, out)
    size_mb = Path(path).stat().st_size / 1e6
    print(f"wrote {path} ({size_mb:.1f} MB, {net.cfg.name}, {net.cfg.dtype})")
