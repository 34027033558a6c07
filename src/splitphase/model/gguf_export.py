"""Export a baseline model to GGUF (llama.cpp's file format) with the `gguf` package.

The layout is llama.cpp's "llama" architecture: tensor names `blk.{i}.attn_q.weight`, ...,
norms in fp32, matrices in the model's dtype (F32 or BF16). Q and K rows are permuted from
Hugging Face's rotate-half RoPE layout to GGML's interleaved pairs, as llama.cpp's own
`convert_hf_to_gguf.py` does. The tokenizer is written as a GPT-2 style byte-level BPE,
padded with unused tokens up to the model's vocabulary size (placeholder texts when none fits).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from splitphase.errors import UserError
from splitphase.model.config import ModelConfig
from splitphase.model.tokenizer import Tokenizer, byte_level_chars
from splitphase.model.transformer import Transformer


class ExportError(UserError):
    """A model that GGUF export does not cover; the message says what is supported."""


def _gguf() -> Any:
    try:
        import gguf
    except ImportError as exc:
        raise ExportError("GGUF export needs the `gguf` package: pip install gguf") from exc
    return gguf


def rope_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows (heads * D, in) from rotate-half order to interleaved pairs, per head."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _check(cfg: ModelConfig) -> None:
    if cfg.is_dual_flow or cfg.is_moe or cfg.qk_norm or cfg.rope_scaling_factor > 1.0:
        raise ExportError(
            "GGUF export covers dense baseline Llama models (no Dual-Flow, MoE, QK-norm or "
            f"RoPE scaling); {cfg.name!r} is not one"
        )


def gguf_tensors(model: Transformer) -> dict[str, torch.Tensor]:
    """GGUF name -> tensor (Q/K permuted), in llama.cpp's naming."""
    cfg = model.cfg
    state = {k: v.detach() for k, v in model.state_dict().items()}
    names = {
        "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    }
    out = {
        "token_embd.weight": state["embed_tokens.weight"],
        "output_norm.weight": state["norm.weight"],
    }
    if not cfg.tie_embeddings:
        out["output.weight"] = state["lm_head.weight"]
    for i in range(cfg.n_layers):
        for ours, theirs in names.items():
            w = state[f"layers.{i}.{ours}.weight"]
            if theirs == "attn_q":
                w = rope_permute(w, cfg.n_heads)
            elif theirs == "attn_k":
                w = rope_permute(w, cfg.n_kv_heads)
            out[f"blk.{i}.{theirs}.weight"] = w
    return out


def _numpy(t: torch.Tensor, gguf: Any) -> tuple[np.ndarray, Any]:
    if t.dim() == 1 or t.dtype == torch.float32:
        return t.float().contiguous().numpy(), None  # norms always fp32, as llama.cpp expects
    if t.dtype == torch.bfloat16:
        raw = t.contiguous().view(torch.int16).numpy().view(np.uint16)  # bf16 bits
        return raw, gguf.GGMLQuantizationType.BF16
    raise ExportError(f"GGUF export supports float32 and bfloat16 weights, got {t.dtype}")


def _write_tokenizer(w: Any, gguf: Any, tok: Tokenizer, vocab_size: int) -> None:
    doc = json.loads(tok.to_str())
    vocab: dict[str, int] = doc["model"]["vocab"]
    for added in doc.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    if len(vocab) > vocab_size:
        raise ExportError(f"tokenizer has {len(vocab)} tokens, the model only {vocab_size}")
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED] * vocab_size
    special = {a["id"] for a in doc.get("added_tokens", [])}
    for text, idx in vocab.items():
        tokens[idx] = text
        types[idx] = gguf.TokenType.CONTROL if idx in special else gguf.TokenType.NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in doc["model"].get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    if tok.bos_token_id is not None:
        w.add_bos_token_id(tok.bos_token_id)
    if tok.eos_token_id is not None:
        w.add_eos_token_id(tok.eos_token_id)


def _write_placeholder_vocab(w: Any, gguf: Any, vocab_size: int) -> None:
    # A model without a fitting tokenizer (a random preset) still needs a vocabulary for
    # llama.cpp to load; ids are what benchmarks feed, so the texts are placeholders: the 256
    # byte-level characters (llama.cpp looks up the newline's), one merge, then numbered ids.
    if vocab_size < 258:
        raise ExportError(f"a placeholder vocabulary needs >= 258 ids, the model has {vocab_size}")
    by_byte = sorted(byte_level_chars().items(), key=lambda kv: kv[1])
    tokens = [ch for ch, _ in by_byte] + ["\u0120\u0120"]
    tokens += [f"<|id{i}|>" for i in range(len(tokens), vocab_size)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * vocab_size)
    w.add_token_merges(["\u0120 \u0120"])
    w.add_bos_token_id(vocab_size - 1)
    w.add_eos_token_id(vocab_size - 1)


def export_gguf(model: Transformer, tok: Tokenizer | None, path: str | Path) -> Path:
    """Write `model` (and `tok`, else placeholder token texts) to a GGUF file at `path`."""
    cfg = model.cfg
    _check(cfg)
    gguf = _gguf()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(cfg.name)
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.d_model)
    w.add_block_count(cfg.n_layers)
    w.add_feed_forward_length(cfg.d_ff)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    is_bf16 = model.dtype == torch.bfloat16
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if is_bf16 else gguf.LlamaFileType.ALL_F32)
    if tok is None:
        _write_placeholder_vocab(w, gguf, cfg.vocab_size)
    else:
        _write_tokenizer(w, gguf, tok, cfg.vocab_size)
    for name, t in gguf_tensors(model).items():
        data, raw = _numpy(t, gguf)
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
