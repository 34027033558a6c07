"""Shards: layout, boundaries and meta for the shipped tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from splitphase.data.shards import load_meta, load_split, load_val_boundaries
from splitphase.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def shards(prepared_shards: tuple[Path, dict[str, Any]]) -> tuple[Path, dict[str, Any]]:
    return prepared_shards


def test_layout(shards: tuple[Path, dict[str, Any]]) -> None:
    out, meta = shards
    tok = Tokenizer.default()
    for split in ("train", "val"):
        tokens = load_split(out, split)
        info = meta["splits"][split]
        assert tokens.dtype == np.uint16 and len(tokens) == info["tokens"]
        assert tokens[0] == 0 and tokens[-1] == 0
        assert int((tokens == 0).sum()) == len(info["doc_ids"]) + 1
        starts = info["doc_offsets"]
        assert all(tokens[s - 1] == 0 for s in starts)
    val = load_split(out, "val")
    first = tok.decode(val[1:meta["splits"]["val"]["doc_offsets"][1] - 1].tolist())
    assert first.startswith("The Second Book of Samuel")
    assert load_meta(out)["tokenizer"]["sha256"] == tok.sha256()


def test_boundaries_start_lines(shards: tuple[Path, dict[str, Any]]) -> None:
    out, meta = shards
    tok = Tokenizer.default()
    val, bounds = load_split(out, "val"), load_val_boundaries(out)
    assert len(bounds) == meta["val_boundaries"]["count"] > 10_000
    assert np.all(np.diff(bounds) > 0)
    starts = set(meta["splits"]["val"]["doc_offsets"])
    for p in bounds[:: max(1, len(bounds) // 200)]:
        assert int(p) not in starts and val[p] != 0
        assert tok.token_bytes(int(val[p - 1])).endswith(b"\n")


def test_missing_split_says_how(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="splitphase data prepare"):
        load_split(tmp_path, "val")
    with pytest.raises(ValueError, match="split must be"):
        load_split(tmp_path, "test")
