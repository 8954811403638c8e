"""The evaluation: questions built from the corpus, each with the verse it comes from; recall@1,
5 and 10 of dense, BM25 and hybrid retrieval (a hit: a retrieved chunk holds the verse); then the
whole pipeline on some of them against an aieng server, with p50/p99 latency per step.

Dense retrieval is measured with the bundled model's mean-pooled states (the embedder the
service uses) and, with `--biencoder DIR`, with a bi-encoder trained by `aieng train --objective
contrastive` (its own pooling files), each alone and fused with BM25.

A question is a verse's words with about a third of its content words dropped and two
neighbouring words swapped (seeded), so it shares the verse's vocabulary but not its wording.

    cd examples/rag && PYTHONPATH=.:../../python python -m kjv_rag.evaluate \
        --biencoder /path/to/kjv-biencoder --out ../../benches/results/rag_evaluation.md
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import re
import tempfile
from dataclasses import dataclass

import numpy as np

from aieng.benchmarks.offline import machine
from kjv_rag.aieng_server import aieng_server, served_model
from kjv_rag.app import build_pipeline
from kjv_rag.chunks import load_verses, verse_windows
from kjv_rag.conversation import Conversation
from kjv_rag.embedder import AiengEmbedder, ServerEmbedder
from kjv_rag.index import HybridIndex
from kjv_rag.steps import STOPWORDS, RagContext

EVAL_BOOKS = ("Ruth", "Ecclesiastes", "Jonah", "Mark", "Philippians")  # the model's held-out
KS = (1, 5, 10)


@dataclass(frozen=True)
class Question:
    text: str
    verse: str  # "Mark 4:39": the verse it was made from


def make_questions(verses, count: int, seed: int = 0) -> list[Question]:
    rng = random.Random(seed)
    pool = [v for v in verses if len(v.text.split()) >= 8]
    questions = []
    for verse in rng.sample(pool, count):
        words = re.findall(r"[A-Za-z']+", verse.text)
        kept = [w for w in words if w.lower() in STOPWORDS or rng.random() > 0.33]
        if len(kept) > 3:
            i = rng.randrange(len(kept) - 1)
            kept[i], kept[i + 1] = kept[i + 1], kept[i]
        questions.append(Question(" ".join(kept), verse.ref))
    return questions


def recall(index: HybridIndex, embedder, questions: list[Question]) -> dict:
    """{"dense" | "bm25" | "hybrid": {k: recall@k}} of `index` (embedded by `embedder`)."""
    vectors = embedder.embed([q.text for q in questions])
    depth = max(KS)
    found: dict[str, list[int]] = {"dense": [], "bm25": [], "hybrid": []}
    for q, vector in zip(questions, vectors, strict=True):
        rankings = {
            "dense": index.dense(vector, depth),
            "bm25": index.sparse(q.text, depth),
            "hybrid": index.hybrid(q.text, vector, depth),
        }
        for name, hits in rankings.items():
            ranks = [r for r, h in enumerate(hits) if q.verse in index.chunks[h.chunk].verses]
            found[name].append(ranks[0] if ranks else depth)
    return {name: {k: float(np.mean(np.asarray(r) < k)) for k in KS} for name, r in found.items()}


def biencoder_recall(folder: str, verses, questions: list[Question], stack) -> dict:
    """Dense and hybrid recall with the bi-encoder's own index (embedded in this process)."""
    encoder = AiengEmbedder(folder, pooling=None)
    stack.callback(encoder.close)
    index = HybridIndex.build(
        stack.enter_context(tempfile.TemporaryDirectory()), verse_windows(verses), encoder
    )
    stack.callback(index.close)
    rows = recall(index, encoder, questions)
    return {f"{name} (KJV bi-encoder)": rows[name] for name in ("dense", "hybrid")}


async def step_latencies(pipeline, questions: list[Question]) -> dict[str, list[float]]:
    timings: dict[str, list[float]] = {}
    for q in questions:
        ctx = await pipeline.run(RagContext(q.text, Conversation()))
        for step, seconds in ctx.timings.items():
            timings.setdefault(step, []).append(seconds)
        timings.setdefault("total", []).append(sum(ctx.timings.values()))
    return timings


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--questions", type=int, default=120)
    parser.add_argument("--pipeline-questions", type=int, default=30)
    parser.add_argument("--index", default=None, help="an index folder (built if missing)")
    parser.add_argument("--port", type=int, default=8111)
    parser.add_argument("--out", default=None, help="write the markdown table here")
    parser.add_argument(
        "--biencoder", default=None, help="a bi-encoder folder (aieng train --objective "
        "contrastive) measured beside the bundled model's embeddings",
    )  # fmt: skip
    args = parser.parse_args()
    verses = load_verses(EVAL_BOOKS)
    questions = make_questions(verses, args.questions)
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(aieng_server(args.port, "--max-queue-requests", "1024"))
        embedder = ServerEmbedder(url, served_model(url))
        folder = args.index or stack.enter_context(tempfile.TemporaryDirectory())
        if HybridIndex.exists(folder):
            index = HybridIndex.open(folder)
        else:
            index = HybridIndex.build(folder, verse_windows(verses), embedder)
        stack.callback(index.close)
        table = {
            f"{name}{' (aieng-kjv-6m, mean-pooled)' if name != 'bm25' else ''}": row
            for name, row in recall(index, embedder, questions).items()
        }
        if args.biencoder:
            table.update(biencoder_recall(args.biencoder, verses, questions, stack))
        pipeline = build_pipeline(index, embedder, url, served_model(url), answer_tokens=64)
        latencies = asyncio.run(step_latencies(pipeline, questions[: args.pipeline_questions]))
        num_chunks = len(index.chunks)
    info = machine(threads=0)
    lines = [
        f"# KJV RAG evaluation ({len(questions)} questions from {', '.join(EVAL_BOOKS)}; "
        f"{len(verses)} verses in {num_chunks} chunks)",
        "",
        f"Machine: {info['cpu']} ({info['cpu_features']}), {info['nproc']} CPUs (shared with "
        "other work while "
        "measured). Embedders: the bundled aieng-kjv-6m model, mean-pooled final hidden states "
        "through `POST /v1/embeddings`"
        + (
            f"; the KJV bi-encoder `{args.biencoder}` (`aieng train --objective contrastive`, "
            "its own pooling files) through `LLM.embed`"
            if args.biencoder
            else ""
        )
        + "; Qdrant embedded (exact search), BM25 (bm25s), hybrid = reciprocal rank fusion. "
        "The pipeline runs with the bundled model's embeddings.",
        "",
        "| retrieval | recall@1 | recall@5 | recall@10 |",
        "|---|---|---|---|",
    ]
    for name, values in table.items():
        lines.append(f"| {name} | " + " | ".join(f"{values[k]:.3f}" for k in KS) + " |")
    lines += [
        "",
        f"Pipeline latency per step over {args.pipeline_questions} questions "
        "(generation: 64 tokens at most, greedy):",
        "",
        "| step | p50 ms | p99 ms |",
        "|---|---|---|",
    ]
    for step, values in latencies.items():
        p50, p99 = np.percentile(np.asarray(values) * 1000, [50, 99])
        lines.append(f"| {step} | {p50:.1f} | {p99:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
