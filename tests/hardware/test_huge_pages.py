"""Large weights copied onto 2 MiB pages: aligned, equal, in place, and only where THP is on."""

from __future__ import annotations

import copy
import gc
import resource
from pathlib import Path

import pytest
import torch

from splitphase.hardware import huge_pages
from splitphase.hardware.huge_pages import (
    HUGE_PAGE_BYTES,
    huge_page_copy,
    transparent_huge_pages,
    weights_on_huge_pages,
)
from splitphase.model.config import ModelConfig
from splitphase.model.transformer import Transformer

needs_thp = pytest.mark.skipif(not transparent_huge_pages(), reason="THP off on this kernel")


def test_copy_is_aligned_equal_and_outlives_its_names() -> None:
    t = torch.randn(3, 1000, 700)  # 8.4 MB, not a whole number of huge pages
    c = huge_page_copy(t)
    assert c is not None and c.shape == t.shape and c.dtype == t.dtype and c.is_contiguous()
    assert c.data_ptr() % HUGE_PAGE_BYTES == 0
    assert torch.equal(c, t)
    bf = huge_page_copy(t.to(torch.bfloat16))
    assert bf is not None and torch.equal(bf, t.to(torch.bfloat16))
    gc.collect()  # the mapping lives as long as the tensor, with no other name for it
    c.add_(1.0)
    assert torch.equal(c, t + 1.0)


@needs_thp
def test_copy_faults_in_whole_huge_pages() -> None:
    t = torch.ones(8 * HUGE_PAGE_BYTES // 4)  # 16 MiB: 4096 small pages or 8 huge ones
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    c = huge_page_copy(t)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert c is not None and torch.equal(c, t)
    assert faults < 4096 // 4, f"{faults} page faults: the copy did not get huge pages"


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = torch.nn.Linear(1024, 1024, bias=False)  # 4 MiB
        self.small = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(1024, 1024, bias=False)
        self.head.weight = self.big.weight  # tied


@needs_thp
def test_moves_large_parameters_in_place_and_keeps_ties() -> None:
    m = _Tied()
    big, small = m.big.weight, m.small.weight
    values, small_ptr = big.detach().clone(), small.data_ptr()
    moved = weights_on_huge_pages(m)
    assert moved == 1024 * 1024 * 4  # once, though two modules hold it
    assert m.big.weight is big and m.head.weight is big and big.requires_grad
    assert big.data_ptr() % HUGE_PAGE_BYTES == 0 and torch.equal(big, values)
    assert small.data_ptr() == small_ptr
    ptr = big.data_ptr()
    assert weights_on_huge_pages(m) == 0 and big.data_ptr() == ptr  # moved once, for good


def test_nothing_moves_where_thp_is_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr(huge_pages, "_THP_SETTING", setting)
    assert not transparent_huge_pages()
    m = _Tied()
    ptr = m.big.weight.data_ptr()
    assert weights_on_huge_pages(m) == 0 and m.big.weight.data_ptr() == ptr
    monkeypatch.setattr(huge_pages, "_THP_SETTING", tmp_path / "missing")
    assert not transparent_huge_pages()


@needs_thp
def test_a_model_decodes_the_same_on_huge_pages() -> None:
    torch.manual_seed(0)
    cfg = ModelConfig.from_name("tiny").with_(vocab_size=8192)  # a 2 MiB embedding
    model = Transformer(cfg).eval()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    with torch.inference_mode():
        ref_logits, ref_cache = ref.prefill(ids, ref.new_cache(2, 12))
        ref.decode_step(ids[:, -1], ref_cache)  # its decode weight list is built now
        assert ref._decode_weight_list is not None
        assert weights_on_huge_pages(ref) > 0  # a model already used: its caches are dropped
        assert ref._decode_weight_list is None  # (Transformer._apply, as for .to())
        assert weights_on_huge_pages(model) >= cfg.vocab_size * cfg.d_model * 4
        logits, cache = model.prefill(ids, model.new_cache(2, 12))
        step = model.decode_step(ids[:, -1], cache)
        ref_logits2, ref_cache2 = ref.prefill(ids, ref.new_cache(2, 12))
        ref_step = ref.decode_step(ids[:, -1], ref_cache2)
    assert model.embed_tokens.weight.data_ptr() % HUGE_PAGE_BYTES == 0
    assert torch.equal(logits, ref_logits) and torch.equal(ref_logits2, ref_logits)
    assert torch.equal(step, ref_step)
