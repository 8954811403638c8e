"""One command: `python -m kjv_rag` (from examples/rag, or a copy of it, with aieng installed)
starts an aieng server (the bundled KJV model: generation and embeddings) on a free port,
builds the index if it is missing, and serves the RAG API (port 8100, or `--port`; 0: a free
one, printed).

    PYTHONPATH=. python -m kjv_rag --books Ruth Jonah Mark --port 8100
    curl -s localhost:8100/v1/ask -H 'content-type: application/json' \
        -d '{"question": "whither thou goest, I will go"}'
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys

import uvicorn

from kjv_rag.aieng_server import aieng_server, free_port, served_model
from kjv_rag.app import build_pipeline
from kjv_rag.chunks import load_verses, verse_windows
from kjv_rag.embedder import ServerEmbedder
from kjv_rag.index import HybridIndex
from kjv_rag.service import build_service

DEFAULT_BOOKS = ("Ruth", "Jonah", "Mark")  # a few minutes to index on two CPU cores


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kjv_rag", description=__doc__.split("\n\n")[0])
    parser.add_argument("--index", default="kjv-index", help="the index folder")
    parser.add_argument("--books", nargs="*", default=list(DEFAULT_BOOKS), help="'all': every book")
    parser.add_argument("--qdrant-url", default=None, help="a Qdrant server (default: embedded)")
    parser.add_argument("--generation-url", default=None, help="an aieng server's /v1 URL")
    parser.add_argument("--port", type=int, default=8100, help="the API's (0: a free one)")
    parser.add_argument("--aieng-port", type=int, default=0, help="the aieng server's (0: free)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    with contextlib.ExitStack() as stack:
        url = args.generation_url or stack.enter_context(aieng_server(args.aieng_port))
        embedder = ServerEmbedder(url, served_model(url))
        stack.callback(embedder.close)
        index = open_or_build(args.index, args.books, embedder, args.qdrant_url)
        stack.callback(index.close)
        pipeline = build_pipeline(index, embedder, url, served_model(url))
        port = args.port or free_port()
        print(f"serving the RAG API on http://127.0.0.1:{port}", flush=True)
        uvicorn.run(build_service(pipeline), host="127.0.0.1", port=port)


def open_or_build(folder: str, books: list[str], embedder, qdrant_url: str | None) -> HybridIndex:
    if HybridIndex.exists(folder):
        return HybridIndex.open(folder, qdrant_url)
    chunks = verse_windows(load_verses(None if books == ["all"] else books))
    print(f"indexing {len(chunks)} chunks into {folder} ...", flush=True)
    return HybridIndex.build(folder, chunks, embedder, qdrant_url)


if __name__ == "__main__":
    main(sys.argv[1:])
