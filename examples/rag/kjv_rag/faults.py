"""Fault injection: a real retriever or step made to fail or to be slow, to exercise (and
demonstrate) each declared degrade."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from kjv_rag.steps import Passage, RagContext, Retriever, Step


class FaultyRetriever:
    """The real retriever behind a fault: `error` raised, or `delay_s` of waiting first."""

    def __init__(
        self, inner: Retriever, error: Exception | None = None, delay_s: float = 0.0
    ) -> None:
        self.inner, self.error, self.delay_s = inner, error, delay_s

    def search(self, query: str, k: int) -> tuple[list[Passage], np.ndarray]:
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.error is not None:
            raise self.error
        return self.inner.search(query, k)


class DelayedStep:
    """A real step that starts `delay_s` late (a slow dependency), keeping its own timeout and
    its own degrade."""

    def __init__(self, inner: Step, delay_s: float) -> None:
        self.inner, self.delay_s = inner, delay_s
        self.name, self.timeout_s = inner.name, inner.timeout_s

    async def run(self, ctx: RagContext) -> None:
        await asyncio.sleep(self.delay_s)
        await self.inner.run(ctx)

    def degrade(self, ctx: RagContext, error: BaseException) -> None:
        self.inner.degrade(ctx, error)
