"""The pipeline wired to its parts: an index, an aieng embedder, an aieng server for generation."""

from __future__ import annotations

from dataclasses import dataclass

from kjv_rag.embedder import AiengEmbedder, ServerEmbedder
from kjv_rag.index import HybridIndex
from kjv_rag.pipeline import Pipeline, PipelineMetrics
from kjv_rag.steps import (
    Assemble,
    Cite,
    Generate,
    HybridRetriever,
    Rerank,
    Retrieve,
    Retriever,
    Rewrite,
)


@dataclass(frozen=True)
class Timeouts:
    rewrite: float = 0.5
    retrieve: float = 10.0
    rerank: float = 1.0
    generate: float = 60.0


def build_pipeline(
    index: HybridIndex,
    embedder: AiengEmbedder | ServerEmbedder,
    generation_url: str,
    model: str,
    answer_tokens: int = 96,
    timeouts: Timeouts = Timeouts(),
    retriever: Retriever | None = None,
    metrics: PipelineMetrics | None = None,
) -> Pipeline:
    """`retriever` replaces the index's hybrid search (fault injection wraps it)."""
    return Pipeline(
        [
            Rewrite(timeouts.rewrite),
            Retrieve(retriever or HybridRetriever(index, embedder), timeout_s=timeouts.retrieve),
            Rerank(index, timeouts.rerank),
            Assemble(embedder.count_tokens, embedder.max_tokens + 1, answer_tokens),
            Generate(generation_url, model, answer_tokens, timeouts.generate),
            Cite(),
        ],
        metrics,
    )
