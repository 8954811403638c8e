"""Training text: plain-text files, and the King James Bible from Debian's `bible-kjv` package.

`bible "Genesis 1:1-Revelation 22:21"` prints the text with a "Book N" heading per chapter and a
number before each verse, wrapped at 80 columns. `kjv_books` turns that into plain verses (one per
line), keeps whole books together, and `split_books` holds whole books out for evaluation.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

KJV_RANGE = "Genesis 1:1-Revelation 22:21"
# Held out for evaluation: prose, poetry, prophecy, gospel and epistle, about 5% of the text.
KJV_HELDOUT_BOOKS = ("Ruth", "Ecclesiastes", "Jonah", "Mark", "Philippians")

_HEADING = re.compile(r"^((?:[1-3] )?[A-Z][A-Za-z ]+?) (\d+)$")
_VERSE = re.compile(r"^\s+(\d+) (.*)$")
CHAPTER_SEPARATOR = "\n\n"


class CorpusError(RuntimeError):
    pass


def kjv_raw_text() -> str:
    """The KJV as the `bible` program prints it; needs `apt-get install bible-kjv`."""
    program = shutil.which("bible")
    if program is None:
        raise CorpusError(
            "the `bible` program was not found: install Debian's bible-kjv package "
            "(apt-get install bible-kjv)"
        )
    done = subprocess.run([program, KJV_RANGE], capture_output=True, text=True, check=False)
    if done.returncode != 0 or not done.stdout.strip():
        raise CorpusError(f"`bible {KJV_RANGE}` failed: {done.stderr.strip()}")
    return done.stdout


@dataclass(frozen=True)
class Verse:
    book: str
    chapter: int
    verse: int
    text: str

    @property
    def ref(self) -> str:
        """ "John 11:35"."""
        return f"{self.book} {self.chapter}:{self.verse}"


def kjv_verses(raw: str) -> list[Verse]:
    """Every verse with its book, chapter and number, in order (wrapped lines joined)."""
    verses: list[Verse] = []
    book, chapter = "", 0
    for line in raw.splitlines():
        if not line.strip():
            continue
        heading = _HEADING.match(line)
        if heading:
            book, chapter = heading.group(1), int(heading.group(2))
            continue
        verse = _VERSE.match(line)
        if verse and book:
            verses.append(Verse(book, chapter, int(verse.group(1)), verse.group(2).strip()))
        elif verses and book:  # a wrapped continuation of the verse before
            last = verses[-1]
            verses[-1] = Verse(last.book, last.chapter, last.verse, f"{last.text} {line.strip()}")
        else:
            raise CorpusError(f"unexpected line before any verse: {line!r}")
    return verses


def kjv_books(raw: str) -> dict[str, list[str]]:
    """book -> its chapters, each chapter its verses joined by newlines (no numbers)."""
    chapters: dict[tuple[str, int], list[str]] = {}
    for verse in kjv_verses(raw):
        chapters.setdefault((verse.book, verse.chapter), []).append(verse.text)
    books: dict[str, list[str]] = {}
    for (book, _), texts in chapters.items():
        books.setdefault(book, []).append("\n".join(texts))
    return books


def split_books(
    books: dict[str, list[str]], heldout: tuple[str, ...] = KJV_HELDOUT_BOOKS
) -> tuple[str, str]:
    """-> (training text, held-out text); chapters separated by a blank line."""
    missing = [b for b in heldout if b not in books]
    if missing:
        raise CorpusError(f"held-out books not in the corpus: {missing}")
    train = [c for b, chapters in books.items() if b not in heldout for c in chapters]
    held = [c for b in heldout for c in books[b]]
    return CHAPTER_SEPARATOR.join(train) + "\n", CHAPTER_SEPARATOR.join(held) + "\n"


def write_kjv(folder: str | Path) -> tuple[Path, Path]:
    """Writes train.txt and heldout.txt under `folder`; returns their paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    train, held = split_books(kjv_books(kjv_raw_text()))
    train_path, held_path = folder / "train.txt", folder / "heldout.txt"
    train_path.write_text(train, encoding="utf-8")
    held_path.write_text(held, encoding="utf-8")
    return train_path, held_path


def read_documents(path: str | Path) -> list[str]:
    """A text file's documents: blocks separated by a blank line (a chapter, in the KJV)."""
    path = Path(path)
    if not path.is_file():
        raise CorpusError(f"no such text file: {path}")
    text = path.read_text(encoding="utf-8")
    docs = [d.strip() for d in re.split(r"\n\s*\n", text) if d.strip()]
    if not docs:
        raise CorpusError(f"{path} holds no text")
    return docs
