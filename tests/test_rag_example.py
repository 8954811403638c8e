"""The KJV retrieval-augmented service (examples/rag) end to end on a real index (the book of
Jonah, embedded by the bundled model through aieng, in embedded Qdrant and BM25), generating on
a real aieng server; and every declared degrade under injected faults: retrieval raising and
timing out (the model answers alone), rerank slow (skipped), generation refused with 429 and
503 (the passages come back with citations). No request is lost: every question is answered
200, and the generation server's KV pool is whole afterwards."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from server_fixtures import MODEL_NAME, ThreadServer

from aieng.config.default_model import default_model_path
from aieng.server.admission import ServerState

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "rag"))

from kjv_rag.app import Timeouts, build_pipeline
from kjv_rag.chunks import load_verses, verse_windows
from kjv_rag.conversation import Conversation
from kjv_rag.embedder import ServerEmbedder
from kjv_rag.evaluate import choose_dense_weight, make_questions, rankings, recall, recall_at
from kjv_rag.faults import DelayedStep, FaultyRetriever
from kjv_rag.index import Hit, HybridIndex, fuse
from kjv_rag.pipeline import PipelineMetrics
from kjv_rag.service import build_service
from kjv_rag.steps import HybridRetriever

QUESTION = "How long was Jonah in the belly of the fish?"
STEPS = ["rewrite", "retrieve", "rerank", "assemble", "generate", "cite"]
ANSWER_TOKENS = 24


@pytest.fixture(scope="module")
def embedder(server):
    embedder = ServerEmbedder(f"{server.url}/v1", MODEL_NAME)
    yield embedder
    embedder.close()


@pytest.fixture(scope="module")
def index(embedder, tmp_path_factory):
    chunks = verse_windows(load_verses(["Jonah"]))
    index = HybridIndex.build(tmp_path_factory.mktemp("index"), chunks, embedder)
    yield index
    index.close()


@pytest.fixture(scope="module")
def server():
    engine = {"kv_cache_memory": 1 << 25, "max_num_seqs": 2}
    with ThreadServer(default_model_path(), engine=engine, max_queue_requests=64) as s:
        yield s
        s.wait_idle()
        s.in_engine(lambda engine: engine.check_pool_whole())


@pytest.fixture(scope="module")
def busy_server():
    """A second generation server that queues one request at most (retrieval's embeddings go
    on through `server`)."""
    engine = {"kv_cache_memory": 1 << 24, "max_num_seqs": 1}
    with ThreadServer(default_model_path(), engine=engine, max_queue_requests=1) as s:
        yield s
        s.wait_idle()
        s.in_engine(lambda engine: engine.check_pool_whole())


def _service(index, embedder, server, **kwargs):
    metrics = PipelineMetrics()
    pipeline = build_pipeline(
        index, embedder, f"{server.url}/v1", MODEL_NAME, ANSWER_TOKENS, metrics=metrics, **kwargs
    )
    return TestClient(build_service(pipeline)), pipeline


def _ask(client: TestClient, **body) -> dict:
    response = client.post("/v1/ask", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def _outcomes(client: TestClient) -> dict[tuple[str, str], float]:
    text = client.get("/metrics").text
    return {
        (s.labels["step"], s.labels["outcome"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "rag_step_outcomes_total"
    }


def test_answers_with_citations_streamed_and_remembered(index, embedder, server):
    client, _ = _service(index, embedder, server)
    body = _ask(client, question=QUESTION, conversation_id="c1")
    assert body["degraded"] == [] and body["skipped"] == []
    assert isinstance(body["answer"], str)
    assert list(body["timings_ms"]) == STEPS
    verses = {v for c in body["citations"] for v in c["verses"]}
    assert "Jonah 1:17" in verses, [c["id"] for c in body["citations"]]
    assert all(c["id"] in {ch.id for ch in index.chunks} for c in body["citations"])
    # a follow-up that points back borrows the previous question's words
    follow = _ask(client, question="What did he pray there?", conversation_id="c1")
    assert "jonah" in follow["query"] and "pray" in follow["query"]
    # streamed: the deltas make the answer
    with client.stream("POST", "/v1/ask", json={"question": QUESTION, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: {")]
    import json

    events = [json.loads(line[6:]) for line in lines]
    deltas = "".join(e["delta"] for e in events if "delta" in e)
    final = events[-1]["response"]
    assert deltas.strip() == final["answer"] and final["degraded"] == []
    assert _outcomes(client)[("generate", "ok")] == 3


def test_conversation_window_and_summary():
    conversation = Conversation(window=2, summary_chars=120)
    for i in range(5):
        conversation.add(f"question {i}?", f"Answer {i} first. More text {i}.")
    assert [t.question for t in conversation.turns] == ["question 3?", "question 4?"]
    assert "question 2?" in conversation.summary and "Answer 2 first." in conversation.summary
    assert "More text" not in conversation.summary and len(conversation.summary) <= 120
    assert conversation.as_text().startswith("Earlier: ")


@pytest.mark.parametrize(
    "fault, outcome",
    [
        (dict(error=ConnectionError("qdrant is down")), "degraded"),
        (dict(delay_s=1.5), "timeout"),
    ],
)
def test_retrieval_down_or_slow_answers_from_the_model_alone(
    index, embedder, server, fault, outcome
):
    retriever = FaultyRetriever(HybridRetriever(index, embedder), **fault)
    client, _ = _service(
        index, embedder, server, retriever=retriever, timeouts=Timeouts(retrieve=0.5)
    )
    body = _ask(client, question=QUESTION)
    assert body["degraded"] == ["retrieval"]
    assert body["citations"] == [] and isinstance(body["answer"], str)
    assert "retrieve" in body["errors"]
    assert _outcomes(client)[("retrieve", outcome)] == 1


def test_slow_rerank_is_skipped(index, embedder, server):
    client, pipeline = _service(index, embedder, server, timeouts=Timeouts(rerank=0.2))
    pipeline.steps[2] = DelayedStep(pipeline.steps[2], 1.0)
    body = _ask(client, question=QUESTION)
    assert body["skipped"] == ["rerank"] and body["degraded"] == []
    assert body["citations"] and isinstance(body["answer"], str)
    assert _outcomes(client)[("rerank", "timeout")] == 1


def test_generation_refused_returns_the_passages(index, embedder, busy_server):
    server = busy_server
    client, _ = _service(index, embedder, server)
    # 503: the generation server is draining
    server.in_loop(lambda: setattr(server.ctx.admission, "state", ServerState.DRAINING))
    try:
        drained = _ask(client, question=QUESTION)
    finally:
        server.in_loop(lambda: setattr(server.ctx.admission, "state", ServerState.READY))
    # 429: its one queue place is taken (a request waits while the engine loop is held)
    hold = threading.Thread(target=server.in_engine, args=(lambda _engine: time.sleep(3),))
    hold.start()
    time.sleep(0.3)
    waiting = [
        threading.Thread(
            target=httpx.post,
            args=(f"{server.url}/v1/completions",),
            kwargs=dict(json={"model": MODEL_NAME, "prompt": "And", "max_tokens": 1}, timeout=30),
        )
    ]
    for thread in waiting:
        thread.start()
    time.sleep(0.5)
    try:
        queued = _ask(client, question=QUESTION)
    finally:
        hold.join()
        for thread in waiting:
            thread.join()
    for body, status in ((drained, "503"), (queued, "429")):
        assert body["degraded"] == ["generation"] and body["answer"] is None
        assert status in body["errors"]["generate"]
        assert any("Jonah 1:17" in c["verses"] for c in body["citations"])
    assert _outcomes(client)[("generate", "degraded")] == 2


def test_weighted_fusion_keeps_the_strong_ranking_unless_the_weak_one_agrees():
    """Weight 0: BM25's order. A small dense weight: a hit both rank rises, a dense-only hit
    stays below every BM25 hit. Plain RRF: a dense-only hit passes BM25's own."""
    bm25 = [Hit(1, 9.0), Hit(2, 8.0), Hit(3, 7.0)]
    dense = [Hit(4, 0.9), Hit(3, 0.8)]
    assert [h.chunk for h in fuse([bm25, dense], (1.0, 0.0))] == [1, 2, 3, 4]
    assert [h.chunk for h in fuse([bm25, dense], (1.0, 0.1))] == [3, 1, 2, 4]
    assert [h.chunk for h in fuse([bm25, dense])] == [3, 1, 4, 2]


def test_the_tuned_weight_is_never_worse_than_bm25_on_its_split(index, embedder):
    """The evaluation's choice on a tuning split of Jonah (questions from other verses than the
    reported ones): summed recall at least BM25's alone (weight 0, in the grid, is BM25's
    order), and the reported rows measured with the weight chosen there."""
    verses = load_verses(["Jonah"])
    questions = make_questions(verses, 16)
    tuning = make_questions(verses, 16, seed=1, exclude={q.verse for q in questions})
    assert not {q.verse for q in questions} & {q.verse for q in tuning}
    tuning_lists = rankings(index, embedder, tuning)
    chosen, tuned = choose_dense_weight(index, tuning, tuning_lists)
    bm25 = recall_at(index, tuning, [r["bm25"] for r in tuning_lists])
    assert sum(tuned[chosen].values()) >= sum(bm25.values()) and tuned[0.0] == bm25
    rows, again, _ = recall(index, embedder, questions, tuning)
    assert again == chosen
    assert set(rows) >= {"dense", "bm25", f"hybrid, tuned dense weight {chosen:g}"}


def test_the_readme_runs_from_a_copy_of_the_example(tmp_path):
    """README commands use no path outside the folder; from a copy elsewhere (aieng importable,
    as installed) the one command and the evaluation start."""
    example = Path(__file__).resolve().parent.parent / "examples" / "rag"
    readme = (example / "README.md").read_text()
    blocks = "\n".join(re.findall(r"```bash\n(.*?)```", readme, re.S))
    assert "../" not in blocks and "PYTHONPATH=. python -m kjv_rag" in blocks
    copy = tmp_path / "rag"
    shutil.copytree(example, copy, ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([".", *sys.path[1:]])}
    for module in ("kjv_rag", "kjv_rag.evaluate"):
        done = subprocess.run(
            [sys.executable, "-m", module, "--help"],
            cwd=copy,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert "--port" in done.stdout
