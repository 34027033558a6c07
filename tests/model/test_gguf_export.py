"""GGUF export: llama.cpp's names, shapes and dtypes, the RoPE permutation, the vocabulary."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from splitphase.cli import main
from splitphase.model.config import ModelConfig
from splitphase.model.gguf_export import ExportError, export_gguf, gguf_tensors, rope_permute
from splitphase.model.tokenizer import Tokenizer
from splitphase.model.transformer import Transformer

gguf = pytest.importorskip("gguf")


def test_rope_permute_moves_rotate_half_pairs_next_to_each_other() -> None:
    # One head of dim 4: rotate-half pairs rows (0, 2) and (1, 3); GGML pairs (0, 1), (2, 3).
    w = torch.arange(4.0)[:, None]
    assert rope_permute(w, 1)[:, 0].tolist() == [0.0, 2.0, 1.0, 3.0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_file_holds_every_tensor_in_llama_cpp_layout(tmp_path: Path, dtype: str) -> None:
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name("tiny").with_(dtype=dtype)).eval()
    path = export_gguf(model, None, tmp_path / "m.gguf")
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    expected = gguf_tensors(model)
    assert set(tensors) == set(expected) and len(tensors) == 2 + 9 * model.cfg.n_layers
    want = "F32" if dtype == "float32" else "BF16"
    for name, t in tensors.items():
        assert list(t.shape) == list(reversed(expected[name].shape)), name  # GGUF: innermost first
        assert t.tensor_type.name == ("F32" if expected[name].dim() == 1 else want), name
    q = torch.from_numpy(tensors["blk.0.attn_q.weight"].data.copy())
    if dtype == "float32":
        assert torch.equal(q, rope_permute(model.layers[0].self_attn.q_proj.weight.detach(), 4))
    fields = reader.fields
    assert int(fields["llama.attention.head_count_kv"].parts[-1][0]) == model.cfg.n_kv_heads
    assert len(fields["tokenizer.ggml.tokens"].data) == model.cfg.vocab_size


def test_shipped_model_writes_its_tokenizer(tmp_path: Path) -> None:
    assert main(["export-gguf", "--model", "small", "--out", str(tmp_path / "s.gguf")]) == 0
    reader = gguf.GGUFReader(str(tmp_path / "s.gguf"))
    tokens = reader.fields["tokenizer.ggml.tokens"]
    tok = Tokenizer.default()
    first = bytes(tokens.parts[tokens.data[0]]).decode()
    assert first == "<|endoftext|>" and tok.hf.token_to_id(first) == 0
    assert len(reader.fields["tokenizer.ggml.merges"].data) > 1000


def test_unsupported_models_are_refused_with_a_reason(tmp_path: Path) -> None:
    model = Transformer(ModelConfig.from_name("tiny-moe"))
    with pytest.raises(ExportError, match="dense baseline"):
        export_gguf(model, None, tmp_path / "x.gguf")


def test_llama_cpp_reproduces_our_logits(tmp_path: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python comes with `make bench`")
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name("tiny")).eval()
    path = export_gguf(model, None, tmp_path / "t.gguf")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False)
    ids = [5, 6, 7, 100, 200, 300, 9]
    llm.eval(ids)
    theirs = torch.tensor(llm.scores[: len(ids)].copy())
    with torch.no_grad():
        ours = model(torch.tensor([ids]))[0]
    torch.testing.assert_close(theirs, ours, atol=1e-3, rtol=1e-3)
