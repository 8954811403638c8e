"""Conversation memory: the last `window` turns verbatim, and a summary of the turns that fell
out of the window (each one's question and the first sentence of its answer, newest kept when
the summary outgrows `summary_chars`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

FIRST_SENTENCE = re.compile(r"^(.*?[.;:!?])(\s|$)", re.DOTALL)


@dataclass(frozen=True)
class Turn:
    question: str
    answer: str


@dataclass
class Conversation:
    window: int = 3
    summary_chars: int = 400
    turns: list[Turn] = field(default_factory=list)
    summary: str = ""

    def add(self, question: str, answer: str) -> None:
        self.turns.append(Turn(question, answer))
        while len(self.turns) > self.window:
            self._summarise(self.turns.pop(0))

    def _summarise(self, turn: Turn) -> None:
        match = FIRST_SENTENCE.match(turn.answer.strip())
        gist = (match.group(1) if match else turn.answer.strip())[:160]
        line = f"Q: {turn.question.strip()} A: {gist}".strip()
        self.summary = f"{self.summary} {line}".strip()
        if len(self.summary) > self.summary_chars:  # keep the newest part, from a word start
            cut = self.summary[-self.summary_chars :]
            self.summary = cut[cut.find(" ") + 1 :] if " " in cut else cut

    def last_question(self) -> str | None:
        return self.turns[-1].question if self.turns else None

    def as_text(self) -> str:
        """The history for a prompt: the summary, then the recent turns."""
        parts = [f"Earlier: {self.summary}"] if self.summary else []
        parts += [f"Q: {t.question}\nA: {t.answer}" for t in self.turns]
        return "\n".join(parts)
