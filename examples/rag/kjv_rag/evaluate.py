"""The evaluation: questions built from the corpus, each with the verse it comes from; recall@1,
5 and 10 of dense, BM25 and hybrid retrieval (a hit: a retrieved chunk holds the verse); then the
whole pipeline on some of them against an aieng server, with p50/p99 latency per step.

Hybrid retrieval is weighted reciprocal rank fusion (`index.fuse`); the dense ranking's weight
is chosen on a tuning split of questions made from other verses than the reported ones (the
largest weight with the best summed recall@1/5/10 there), then measured on the reported split
beside plain RRF (weight 1) and the weight the service uses (`index.DENSE_WEIGHT`).

Dense retrieval is measured with the bundled model's mean-pooled states (the embedder the
service uses) and, with `--biencoder DIR`, with a bi-encoder trained by `aieng train --objective
contrastive` (its own pooling files), each alone and fused with BM25.

A question is a verse's words with about a third of its content words dropped and two
neighbouring words swapped (seeded), so it shares the verse's vocabulary but not its wording.

    PYTHONPATH=. python -m kjv_rag.evaluate --out rag_evaluation.md   # from examples/rag or a copy
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
from kjv_rag.index import DENSE_WEIGHT, HybridIndex, fuse
from kjv_rag.steps import STOPWORDS, RagContext

EVAL_BOOKS = ("Ruth", "Ecclesiastes", "Jonah", "Mark", "Philippians")  # the model's held-out
KS = (1, 5, 10)
DENSE_WEIGHTS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0)  # the tuning grid; BM25's weight is 1
FUSION_DEPTH = 50  # each ranking's hits that are fused (as the service fuses them)


@dataclass(frozen=True)
class Question:
    text: str
    verse: str  # "Mark 4:39": the verse it was made from


def make_questions(verses, count: int, seed: int = 0, exclude=frozenset()) -> list[Question]:
    """`count` questions from verses of 8 words or more, none from a verse in `exclude`."""
    rng = random.Random(seed)
    pool = [v for v in verses if len(v.text.split()) >= 8 and v.ref not in exclude]
    questions = []
    for verse in rng.sample(pool, count):
        words = re.findall(r"[A-Za-z']+", verse.text)
        kept = [w for w in words if w.lower() in STOPWORDS or rng.random() > 0.33]
        if len(kept) > 3:
            i = rng.randrange(len(kept) - 1)
            kept[i], kept[i + 1] = kept[i + 1], kept[i]
        questions.append(Question(" ".join(kept), verse.ref))
    return questions


def rankings(index: HybridIndex, embedder, questions: list[Question]) -> list[dict]:
    """Per question, its dense and BM25 rankings (FUSION_DEPTH hits each)."""
    vectors = embedder.embed([q.text for q in questions])
    return [
        {"dense": index.dense(v, FUSION_DEPTH), "bm25": index.sparse(q.text, FUSION_DEPTH)}
        for q, v in zip(questions, vectors, strict=True)
    ]


def recall_at(index: HybridIndex, questions: list[Question], ranked: list[list]) -> dict:
    """{k: recall@k} of one ranking per question."""
    depth = max(KS)
    first = []
    for q, hits in zip(questions, ranked, strict=True):
        ranks = [r for r, h in enumerate(hits[:depth]) if q.verse in index.chunks[h.chunk].verses]
        first.append(ranks[0] if ranks else depth)
    return {k: float(np.mean(np.asarray(first) < k)) for k in KS}


def hybrid(lists: list[dict], dense_weight: float) -> list[list]:
    return [fuse([r["bm25"], r["dense"]], (1.0, dense_weight)) for r in lists]


def choose_dense_weight(index, questions, lists) -> tuple[float, dict[float, dict]]:
    """The grid's largest dense weight with the best summed recall@1/5/10 on `questions` (the
    tuning split), and every weight's recall there."""
    by_weight = {w: recall_at(index, questions, hybrid(lists, w)) for w in DENSE_WEIGHTS}
    best = max(sum(r.values()) for r in by_weight.values())
    chosen = max(w for w, r in by_weight.items() if sum(r.values()) >= best - 1e-12)
    return chosen, by_weight


def recall(index: HybridIndex, embedder, questions: list[Question], tuning: list[Question]):
    """The rows of one embedder: dense, BM25, hybrid at the weight tuned on `tuning`, plain RRF
    and the service's weight (on `questions`); the chosen weight and the tuning table."""
    chosen, tuned = choose_dense_weight(index, tuning, rankings(index, embedder, tuning))
    lists = rankings(index, embedder, questions)
    rows = {
        "dense": recall_at(index, questions, [r["dense"] for r in lists]),
        "bm25": recall_at(index, questions, [r["bm25"] for r in lists]),
        f"hybrid, tuned dense weight {chosen:g}": recall_at(
            index, questions, hybrid(lists, chosen)
        ),
        "hybrid, plain RRF (dense weight 1)": recall_at(index, questions, hybrid(lists, 1.0)),
    }
    if DENSE_WEIGHT != chosen:
        rows[f"hybrid, the service's dense weight {DENSE_WEIGHT:g}"] = recall_at(
            index, questions, hybrid(lists, DENSE_WEIGHT)
        )
    return rows, chosen, tuned


def biencoder_recall(folder: str, verses, questions, tuning, stack) -> dict:
    """Dense and tuned hybrid recall with the bi-encoder's own index (embedded in this
    process)."""
    encoder = AiengEmbedder(folder)
    stack.callback(encoder.close)
    index = HybridIndex.build(
        stack.enter_context(tempfile.TemporaryDirectory()), verse_windows(verses), encoder
    )
    stack.callback(index.close)
    rows, _, _ = recall(index, encoder, questions, tuning)
    return {
        f"{name}; KJV bi-encoder": row
        for name, row in rows.items()
        if name == "dense" or name.startswith("hybrid, tuned")
    }


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
    parser.add_argument("--questions", type=int, default=120, help="reported; as many tuned on")
    parser.add_argument("--pipeline-questions", type=int, default=30)
    parser.add_argument("--index", default=None, help="an index folder (built if missing)")
    parser.add_argument("--port", type=int, default=0, help="the aieng server's (0: a free one)")
    parser.add_argument("--out", default=None, help="write the markdown table here")
    parser.add_argument(
        "--biencoder", default=None, help="a bi-encoder folder (aieng train --objective "
        "contrastive) measured beside the bundled model's embeddings",
    )  # fmt: skip
    args = parser.parse_args()
    verses = load_verses(EVAL_BOOKS)
    questions = make_questions(verses, args.questions)
    tuning = make_questions(verses, args.questions, seed=1, exclude={q.verse for q in questions})
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(aieng_server(args.port, "--max-queue-requests", "1024"))
        embedder = ServerEmbedder(url, served_model(url))
        folder = args.index or stack.enter_context(tempfile.TemporaryDirectory())
        if HybridIndex.exists(folder):
            index = HybridIndex.open(folder)
        else:
            index = HybridIndex.build(folder, verse_windows(verses), embedder)
        stack.callback(index.close)
        rows, chosen, tuned = recall(index, embedder, questions, tuning)
        table = {
            f"{name}{'; aieng-kjv-6m mean-pooled' if name != 'bm25' else ''}": row
            for name, row in rows.items()
        }
        if args.biencoder:
            table.update(biencoder_recall(args.biencoder, verses, questions, tuning, stack))
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
        + "; Qdrant embedded (exact search), BM25 (bm25s), hybrid = weighted reciprocal rank "
        f"fusion (k = 60, BM25's weight 1, the dense ranking's chosen on {len(tuning)} tuning "
        "questions from other verses). The pipeline runs with the bundled model's embeddings "
        f"and the service's dense weight, {DENSE_WEIGHT:g}.",
        "",
        "| retrieval | recall@1 | recall@5 | recall@10 |",
        "|---|---|---|---|",
    ]
    for name, values in table.items():
        lines.append(f"| {name} | " + " | ".join(f"{values[k]:.3f}" for k in KS) + " |")
    lines += [
        "",
        f"The tuning split (aieng-kjv-6m): hybrid recall by the dense ranking's weight; chosen "
        f"{chosen:g}, the largest with the best summed recall:",
        "",
        "| dense weight | recall@1 | recall@5 | recall@10 |",
        "|---|---|---|---|",
    ]
    for weight, values in tuned.items():
        lines.append(f"| {weight:g} | " + " | ".join(f"{values[k]:.3f}" for k in KS) + " |")
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
