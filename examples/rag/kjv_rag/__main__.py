"""One command: `python -m kjv_rag` (from examples/rag) starts an aieng server (the bundled KJV
model: generation and embeddings), builds the index if it is missing, and serves the RAG API.

    cd examples/rag && PYTHONPATH=. python -m kjv_rag --books Ruth Jonah Mark --port 8100
    curl -s localhost:8100/v1/ask -d '{"question": "whither thou goest"}' \
        -H 'content-type: application/json'
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time

import httpx
import uvicorn

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
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--aieng-port", type=int, default=8101)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    server = None
    url = args.generation_url
    if url is None:
        server = subprocess.Popen(
            [sys.executable, "-m", "aieng", "serve", "--port", str(args.aieng_port)],
            env=os.environ.copy(),
        )
        url = f"http://127.0.0.1:{args.aieng_port}/v1"
        _wait_ready(url.removesuffix("/v1"), server)
    embedder = ServerEmbedder(url, _model_name(url))
    if HybridIndex.exists(args.index):
        index = HybridIndex.open(args.index, args.qdrant_url)
    else:
        books = None if args.books == ["all"] else args.books
        chunks = verse_windows(load_verses(books))
        print(f"indexing {len(chunks)} chunks into {args.index} ...", flush=True)
        index = HybridIndex.build(args.index, chunks, embedder, args.qdrant_url)
    try:
        pipeline = build_pipeline(index, embedder, url, _model_name(url))
        uvicorn.run(build_service(pipeline), host="127.0.0.1", port=args.port)
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)
        index.close()
        embedder.close()


def _wait_ready(base: str, server: subprocess.Popen, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if server.poll() is not None:
            raise SystemExit(f"the aieng server exited with {server.returncode}")
        try:
            if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"the aieng server at {base} was not ready in {timeout} s")


def _model_name(url: str) -> str:
    return httpx.get(f"{url}/models", timeout=10).json()["data"][0]["id"]


if __name__ == "__main__":
    main(sys.argv[1:])
