"""The pipeline's steps, each with typed inputs and outputs on one `RagContext`, its own timeout
and a declared degrade:

| step | reads | writes | on failure or timeout |
|---|---|---|---|
| rewrite | question, history | query | the question as asked (`degraded: rewrite`) |
| retrieve | query | candidates, query_vector | no passages: the model alone (`retrieval`) |
| rerank | candidates, query_vector | passages | the fused order kept (`skipped: rerank`) |
| assemble | passages, history | context, prompt | none: it is local arithmetic |
| generate | prompt | answer (streamed) | 429/503/down: passages and citations (`generation`) |
| cite | answer, context | citations | every passage in the context cited |
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import openai

from kjv_rag.chunks import Chunk
from kjv_rag.conversation import Conversation
from kjv_rag.index import HybridIndex

STOPWORDS = frozenset(
    "a an and are as at be by did do does for from had has have he her him his how i in is it "
    "its me my of on or said saith she so that the their them then there they this thou to unto "
    "was we were what when where which who whom why will with ye you".split()
)
PRONOUNS = frozenset("he him his she her it they them their this that these those there".split())
WORD = re.compile(r"[A-Za-z']+")


@dataclass(frozen=True)
class Passage:
    chunk: Chunk
    score: float
    index: int  # into the index's chunks


@dataclass(frozen=True)
class Citation:
    n: int  # the [n] the prompt numbered the passage with
    id: str  # "Ruth 1:15-17"
    verses: tuple[str, ...]
    text: str
    cited: bool  # the answer refers to it ([n] or its reference)


@dataclass
class RagContext:
    """Everything one question carries through the pipeline."""

    question: str
    history: Conversation
    query: str = ""
    query_vector: np.ndarray | None = None
    candidates: list[Passage] = field(default_factory=list)
    passages: list[Passage] = field(default_factory=list)
    context: list[Passage] = field(default_factory=list)
    prompt: str = ""
    answer: str | None = None
    citations: list[Citation] = field(default_factory=list)
    degraded: list[str] = field(default_factory=list)  # what the answer had to do without
    skipped: list[str] = field(default_factory=list)  # optional steps left out
    timings: dict[str, float] = field(default_factory=dict)  # step -> seconds
    errors: dict[str, str] = field(default_factory=dict)  # step -> why it degraded
    on_delta: Callable[[str], Awaitable[None]] | None = None  # streaming: each new text


class Step(Protocol):
    name: str
    timeout_s: float

    async def run(self, ctx: RagContext) -> None: ...

    def degrade(self, ctx: RagContext, error: BaseException) -> None:
        """The declared fallback; re-raises when the step has none."""
        ...


def _terms(text: str) -> list[str]:
    return [w.lower() for w in WORD.findall(text) if w.lower() not in STOPWORDS]


class Rewrite:
    """A follow-up that points back ("what did he say then?") takes the previous question's
    content words; every query loses its stopwords."""

    name = "rewrite"

    def __init__(self, timeout_s: float = 0.5):
        self.timeout_s = timeout_s

    async def run(self, ctx: RagContext) -> None:
        words = [w.lower() for w in WORD.findall(ctx.question)]
        terms = _terms(ctx.question)
        previous = ctx.history.last_question()
        if previous and (len(terms) < 3 or PRONOUNS & set(words)):
            terms = _terms(previous) + [t for t in terms if t not in _terms(previous)]
        ctx.query = " ".join(terms) or ctx.question

    def degrade(self, ctx: RagContext, error: BaseException) -> None:
        ctx.query = ctx.question
        ctx.degraded.append("rewrite")


class Retriever(Protocol):
    def search(self, query: str, k: int) -> tuple[list[Passage], np.ndarray]: ...


class HybridRetriever:
    """Dense and BM25 over the index, fused; the query embedded through aieng."""

    def __init__(self, index: HybridIndex, embedder, depth: int = 50):
        self.index, self.embedder, self.depth = index, embedder, depth

    def search(self, query: str, k: int) -> tuple[list[Passage], np.ndarray]:
        vector = self.embedder.embed([query])[0]
        hits = self.index.hybrid(query, vector, k, self.depth)
        return [Passage(self.index.chunks[h.chunk], h.score, h.chunk) for h in hits], vector


class Retrieve:
    name = "retrieve"

    def __init__(self, retriever: Retriever, k: int = 20, timeout_s: float = 5.0):
        self.retriever, self.k, self.timeout_s = retriever, k, timeout_s

    async def run(self, ctx: RagContext) -> None:
        ctx.candidates, ctx.query_vector = await asyncio.to_thread(
            self.retriever.search, ctx.query, self.k
        )

    def degrade(self, ctx: RagContext, error: BaseException) -> None:
        ctx.candidates = []
        ctx.degraded.append("retrieval")


class Rerank:
    """Each candidate scored by its embedding's cosine with the query's plus the share of the
    query's terms it holds (a lexical check the fused rank lacks), best first."""

    name = "rerank"

    def __init__(self, index: HybridIndex, timeout_s: float = 1.0, keep: int = 8):
        self.index, self.timeout_s, self.keep = index, timeout_s, keep

    async def run(self, ctx: RagContext) -> None:
        ctx.passages = await asyncio.to_thread(self._rerank, ctx)

    def _rerank(self, ctx: RagContext) -> list[Passage]:
        if not ctx.candidates:
            return []
        terms = set(_terms(ctx.query))
        rows = self.index.vectors[[p.index for p in ctx.candidates]]
        dense = rows @ ctx.query_vector if ctx.query_vector is not None else np.zeros(len(rows))
        scored = []
        for passage, cosine in zip(ctx.candidates, dense.tolist(), strict=True):
            overlap = len(terms & set(_terms(passage.chunk.text))) / max(1, len(terms))
            scored.append(Passage(passage.chunk, 0.5 * cosine + overlap, passage.index))
        return sorted(scored, key=lambda p: -p.score)[: self.keep]

    def degrade(self, ctx: RagContext, error: BaseException) -> None:
        ctx.passages = ctx.candidates[: self.keep]
        ctx.skipped.append("rerank")


class Assemble:
    """The prompt: history, numbered passages (best first, as many as the window holds after the
    answer's budget), the question."""

    name = "assemble"

    def __init__(self, count_tokens: Callable[[str], int], window: int, answer_tokens: int):
        self.count_tokens, self.window, self.answer_tokens = count_tokens, window, answer_tokens
        self.timeout_s = 2.0

    async def run(self, ctx: RagContext) -> None:
        history = ctx.history.as_text()
        head = f"{history}\n" if history else ""
        tail = f"Question: {ctx.question}\nAnswer:"
        budget = self.window - self.answer_tokens - self.count_tokens(head + tail)
        if budget <= 0:  # the history alone fills the window: drop it
            head = ""
            budget = self.window - self.answer_tokens - self.count_tokens(tail)
        lines: list[str] = []
        for passage in ctx.passages:
            line = f"[{len(lines) + 1}] ({passage.chunk.id}) {passage.chunk.text}\n"
            cost = self.count_tokens(line)
            if cost > budget:
                break
            lines.append(line)
            ctx.context.append(passage)
            budget -= cost
        ctx.prompt = head + "".join(lines) + tail

    def degrade(self, ctx: RagContext, error: BaseException) -> None:
        raise error


class GenerationUnavailable(Exception):
    """The generation server answered 429 or 503, or could not be reached."""


class Generate:
    """A streamed completion from an aieng server (OpenAI's API)."""

    name = "generate"

    def __init__(self, base_url: str, model: str, max_tokens: int, timeout_s: float):
        self.base_url, self.model, self.max_tokens, self.timeout_s = (
            base_url,
            model,
            max_tokens,
            timeout_s,
        )

    async def run(self, ctx: RagContext) -> None:
        parts: list[str] = []
        # A client per question: its connections belong to the event loop that runs it.
        client = openai.AsyncOpenAI(base_url=self.base_url, api_key="unused", max_retries=0)
        try:
            stream = await client.completions.create(
                model=self.model,
                prompt=ctx.prompt,
                max_tokens=self.max_tokens,
                temperature=0.0,
                stop=["\nQuestion:", "\n\n"],
                stream=True,
            )
            async for chunk in stream:
                text = chunk.choices[0].text if chunk.choices else ""
                if text:
                    parts.append(text)
                    if ctx.on_delta is not None:
                        await ctx.on_delta(text)
        except openai.APIStatusError as error:
            if error.status_code in (429, 503):
                raise GenerationUnavailable(f"{error.status_code}: {error.message}") from error
            raise
        except openai.APIConnectionError as error:
            raise GenerationUnavailable(f"unreachable: {error}") from error
        finally:
            await client.close()
        ctx.answer = "".join(parts).strip()

    def degrade(self, ctx: RagContext, error: BaseException) -> None:
        if not isinstance(error, GenerationUnavailable | TimeoutError):
            raise error
        ctx.answer = None  # the response carries the passages and their citations
        ctx.degraded.append("generation")


class Cite:
    name = "cite"
    timeout_s = 1.0

    async def run(self, ctx: RagContext) -> None:
        answer = ctx.answer or ""
        marks = {int(n) for n in re.findall(r"\[(\d+)\]", answer)}
        ctx.citations = [
            Citation(
                n,
                p.chunk.id,
                p.chunk.verses,
                p.chunk.text,
                n in marks or p.chunk.id.split(":")[0] in answer,
            )
            for n, p in enumerate(ctx.context, start=1)
        ]

    def degrade(self, ctx: RagContext, error: BaseException) -> None:
        ctx.citations = [
            Citation(n, p.chunk.id, p.chunk.verses, p.chunk.text, False)
            for n, p in enumerate(ctx.context, start=1)
        ]
