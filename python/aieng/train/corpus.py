"""Training text: plain-text files, and the King James Bible from Debian's `bible-kjv` package.

`bible "Genesis 1:1-Revelation 22:21"` prints the text with a "Book N" heading per chapter and a
number before each verse, wrapped at 80 columns. `kjv_books` turns that into plain verses (one per
line), keeps whole books together, and `split_books` holds whole books out for evaluation.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

KJV_RANGE = "Genesis 1:1-Revelation 22:21"
# Held out for evaluation: prose, poetry, prophecy, gospel and epistle, about 5% of the text.
KJV_HELDOUT_BOOKS = ("Ruth", "Ecclesiastes", "Jonah", "Mark", "Philippians")

_HEADING = re.compile(r"^((?:[1-3] )?[A-Z][A-Za-z ]+?) (\d+)$")
_VERSE = re.compile(r"^\s+\d+ (.*)$")
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


def kjv_books(raw: str) -> dict[str, list[str]]:
    """book -> its chapters, each chapter its verses joined by newlines (no numbers)."""
    books: dict[str, list[str]] = {}
    verses: list[str] = []

    def close_chapter() -> None:
        if verses:
            books[book].append("\n".join(verses))
            verses.clear()

    book = ""
    for line in raw.splitlines():
        if not line.strip():
            continue
        heading = _HEADING.match(line)
        if heading:
            close_chapter()
            book = heading.group(1)
            books.setdefault(book, [])
            continue
        verse = _VERSE.match(line)
        if verse:
            verses.append(verse.group(1).strip())
        elif verses:  # a wrapped continuation of the verse before
            verses[-1] += " " + line.strip()
        else:
            raise CorpusError(f"unexpected line before any verse: {line!r}")
    close_chapter()
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
