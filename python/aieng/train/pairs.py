"""(query, passage) pairs for contrastive training, built from the corpus without labels.

A document is a chapter, a line a verse (what `corpus.write_kjv` writes). A query is one verse
with each word dropped at random (probability `query_drop`, at least three words kept), so it
shares the verse's vocabulary but not all its wording; its passage is a window of `window`
consecutive lines of the same chapter holding that verse, at a random offset (the retrieval
unit of the RAG example); its hard negative is another window of the same chapter that does
not hold the verse (a random chapter's window when the chapter is too short for one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PairBatch:
    queries: list[str]
    passages: list[str]  # passages[i] answers queries[i]
    negatives: list[str] | None  # negatives[i]: a hard negative of queries[i]


class PairSampler:
    """Draws PairBatches from documents with a torch.Generator (so a saved generator state
    resumes the exact draw)."""

    def __init__(self, documents: list[str], window: int, query_drop: float):
        self.chapters = [lines for d in documents if (lines := _lines(d))]
        if not self.chapters:
            raise ValueError("no lines to build (query, passage) pairs from")
        self.window, self.query_drop = window, query_drop
        # every (chapter, line) a query can come from
        self.anchors = [(c, i) for c, lines in enumerate(self.chapters) for i in range(len(lines))]

    def __len__(self) -> int:
        return len(self.anchors)

    def sample(self, batch_size: int, generator: torch.Generator, negatives: bool) -> PairBatch:
        picks = torch.randint(0, len(self.anchors), (batch_size,), generator=generator).tolist()
        queries, passages, hard = [], [], []
        for pick in picks:
            chapter, line = self.anchors[pick]
            queries.append(self._query(self.chapters[chapter][line], generator))
            passages.append(self._window_holding(chapter, line, generator))
            if negatives:
                hard.append(self._window_without(chapter, line, generator))
        return PairBatch(queries, passages, hard if negatives else None)

    def _query(self, verse: str, generator: torch.Generator) -> str:
        words = verse.split()
        keep = (torch.rand(len(words), generator=generator) >= self.query_drop).tolist()
        kept = [w for w, k in zip(words, keep, strict=True) if k]
        return " ".join(kept if len(kept) >= min(3, len(words)) else words)

    def _window_holding(self, chapter: int, line: int, generator: torch.Generator) -> str:
        lines = self.chapters[chapter]
        size = min(self.window, len(lines))
        lowest, highest = max(0, line - size + 1), min(line, len(lines) - size)
        start = lowest + int(torch.randint(0, highest - lowest + 1, (1,), generator=generator))
        return " ".join(lines[start : start + size])

    def _window_without(self, chapter: int, line: int, generator: torch.Generator) -> str:
        lines = self.chapters[chapter]
        size = min(self.window, len(lines))
        starts = [s for s in range(len(lines) - size + 1) if not s <= line < s + size]
        if not starts:  # a chapter too short: another chapter's window
            other = int(torch.randint(0, len(self.chapters), (1,), generator=generator))
            lines = self.chapters[other]
            size = min(self.window, len(lines))
            starts = list(range(len(lines) - size + 1))
        start = starts[int(torch.randint(0, len(starts), (1,), generator=generator))]
        return " ".join(lines[start : start + size])


def _lines(document: str) -> list[str]:
    return [line.strip() for line in document.splitlines() if line.strip()]
