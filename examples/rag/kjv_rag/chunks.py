"""The corpus as retrieval units: windows of consecutive verses within one chapter, each named
by its verse range ("Ruth 1:1-3") and holding the ids of the verses it covers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from aieng.train.corpus import Verse, kjv_raw_text, kjv_verses

WINDOW = 3  # verses per chunk
STRIDE = 2  # verses between the starts of two chunks (windows overlap by one verse)


@dataclass(frozen=True)
class Chunk:
    id: str  # "Ruth 1:1-3"
    verses: tuple[str, ...]  # ("Ruth 1:1", "Ruth 1:2", "Ruth 1:3")
    text: str

    def to_json(self) -> dict:
        return {"id": self.id, "verses": list(self.verses), "text": self.text}

    @classmethod
    def from_json(cls, data: dict) -> Chunk:
        return cls(data["id"], tuple(data["verses"]), data["text"])


def load_verses(books: Sequence[str] | None = None) -> list[Verse]:
    """The KJV's verses (Debian's bible-kjv), only those of `books` when given."""
    verses = kjv_verses(kjv_raw_text())
    if books is None:
        return verses
    wanted = set(books)
    unknown = wanted - {v.book for v in verses}
    if unknown:
        raise ValueError(f"no such book in the KJV: {', '.join(sorted(unknown))}")
    return [v for v in verses if v.book in wanted]


def verse_windows(
    verses: Sequence[Verse], window: int = WINDOW, stride: int = STRIDE
) -> list[Chunk]:
    """Windows of `window` verses every `stride` verses, never across a chapter; the last
    window of a chapter ends at its last verse."""
    if window < 1 or not 1 <= stride <= window:
        raise ValueError(f"need window >= 1 and 1 <= stride <= window, got {window}, {stride}")
    chapters: dict[tuple[str, int], list[Verse]] = {}
    for verse in verses:
        chapters.setdefault((verse.book, verse.chapter), []).append(verse)
    chunks: list[Chunk] = []
    for (book, chapter), group in chapters.items():
        starts = list(range(0, max(1, len(group) - window + 1), stride))
        if starts[-1] + window < len(group):
            starts.append(len(group) - window)
        for start in starts:
            part = group[start : start + window]
            span = f"{part[0].verse}-{part[-1].verse}" if len(part) > 1 else f"{part[0].verse}"
            chunks.append(
                Chunk(
                    f"{book} {chapter}:{span}",
                    tuple(v.ref for v in part),
                    " ".join(v.text for v in part),
                )
            )
    return chunks
