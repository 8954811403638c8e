"""The index: the chunks' embeddings in Qdrant (embedded, on disk; a server by URL through the
same client) beside a BM25 index (bm25s), and the two fused by weighted reciprocal rank.

Qdrant's collection is built with HNSW m=16, ef_construct=200 and cosine distance. Qdrant's
local mode (`qdrant-client` without a server) searches exactly — it keeps the HNSW settings for
a server but does not build the graph — so recall measured here is the exact search's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import bm25s
import numpy as np
from qdrant_client import QdrantClient, models

from kjv_rag.chunks import Chunk

COLLECTION = "kjv"
HNSW_M = 16
HNSW_EF_CONSTRUCT = 200
RRF_K = 60  # reciprocal rank fusion: weight / (RRF_K + rank)
# The dense ranking's weight in the fusion, BM25's being 1: the weight `python -m
# kjv_rag.evaluate` chose on its tuning questions (apart from those it reports). Plain RRF
# (weight 1) let the bundled model's weak dense ranking pull good BM25 hits down; every weight
# above 0 lost recall@1 there, so BM25 orders what it finds and the dense ranking only adds what
# BM25 does not find (a query sharing no word with a passage): docs/rag.md, Evaluation.
DENSE_WEIGHT = 0.0
UPSERT_BATCH = 256


class Embedder(Protocol):
    dimensions: int

    def embed(self, texts: Sequence[str]) -> np.ndarray: ...


@dataclass(frozen=True)
class Hit:
    chunk: int  # index into HybridIndex.chunks
    score: float


def _bm25_tokens(texts: Sequence[str]):
    return bm25s.tokenize(list(texts), stopwords="en", show_progress=False)


class HybridIndex:
    """Dense (Qdrant) and sparse (BM25) search over the same chunks."""

    def __init__(self, folder: Path, qdrant: QdrantClient, bm25: bm25s.BM25, chunks: list[Chunk]):
        self.folder, self.qdrant, self.bm25, self.chunks = folder, qdrant, bm25, chunks
        self.vectors = np.load(folder / "vectors.npy")  # (chunks, dim) unit rows, for reranking

    @classmethod
    def build(
        cls,
        folder: str | Path,
        chunks: Sequence[Chunk],
        embedder: Embedder,
        qdrant_url: str | None = None,
        batch_size: int = 64,
    ) -> HybridIndex:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        texts = [c.text for c in chunks]
        vectors = np.concatenate(
            [embedder.embed(texts[i : i + batch_size]) for i in range(0, len(texts), batch_size)]
        )
        np.save(folder / "vectors.npy", vectors)
        (folder / "chunks.json").write_text(json.dumps([c.to_json() for c in chunks]))
        client = _client(folder, qdrant_url)
        if client.collection_exists(COLLECTION):
            client.delete_collection(COLLECTION)
        client.create_collection(
            COLLECTION,
            vectors_config=models.VectorParams(
                size=vectors.shape[1], distance=models.Distance.COSINE
            ),
            hnsw_config=models.HnswConfigDiff(m=HNSW_M, ef_construct=HNSW_EF_CONSTRUCT),
        )
        for start in range(0, len(vectors), UPSERT_BATCH):
            ids = list(range(start, min(start + UPSERT_BATCH, len(vectors))))
            client.upsert(
                COLLECTION,
                points=models.Batch(ids=ids, vectors=vectors[ids].tolist()),
            )
        bm25 = bm25s.BM25()
        bm25.index(_bm25_tokens(texts), show_progress=False)
        bm25.save(str(folder / "bm25"))
        return cls(folder, client, bm25, list(chunks))

    @classmethod
    def open(cls, folder: str | Path, qdrant_url: str | None = None) -> HybridIndex:
        folder = Path(folder)
        chunks = [Chunk.from_json(c) for c in json.loads((folder / "chunks.json").read_text())]
        bm25 = bm25s.BM25.load(str(folder / "bm25"))
        return cls(folder, _client(folder, qdrant_url), bm25, chunks)

    @staticmethod
    def exists(folder: str | Path) -> bool:
        return (Path(folder) / "chunks.json").is_file()

    def close(self) -> None:
        self.qdrant.close()

    def dense(self, vector: np.ndarray, k: int) -> list[Hit]:
        points = self.qdrant.query_points(COLLECTION, query=vector.tolist(), limit=k).points
        return [Hit(int(p.id), float(p.score)) for p in points]

    def sparse(self, query: str, k: int) -> list[Hit]:
        k = min(k, len(self.chunks))
        ids, scores = self.bm25.retrieve(_bm25_tokens([query]), k=k, show_progress=False)
        return [Hit(int(i), float(s)) for i, s in zip(ids[0], scores[0], strict=True) if s > 0]

    def hybrid(
        self,
        query: str,
        vector: np.ndarray,
        k: int,
        depth: int = 50,
        dense_weight: float = DENSE_WEIGHT,
    ) -> list[Hit]:
        rankings = [self.sparse(query, depth), self.dense(vector, depth)]
        return fuse(rankings, (1.0, dense_weight))[:k]


def fuse(rankings: Sequence[Sequence[Hit]], weights: Sequence[float] | None = None) -> list[Hit]:
    """Weighted reciprocal rank fusion (Cormack et al., 2009, with a weight per list): the sum
    over the lists of weight / (RRF_K + rank); every weight 1 without `weights`."""
    weights = [1.0] * len(rankings) if weights is None else list(weights)
    scores: dict[int, float] = {}
    for ranking, weight in zip(rankings, weights, strict=True):
        for rank, hit in enumerate(ranking, start=1):
            scores[hit.chunk] = scores.get(hit.chunk, 0.0) + weight / (RRF_K + rank)
    return [Hit(c, s) for c, s in sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))]


def _client(folder: Path, url: str | None) -> QdrantClient:
    return QdrantClient(url=url) if url else QdrantClient(path=str(folder / "qdrant"))
