"""LlamaIndex's OpenAI embeddings (llama-index-embeddings-openai, a test dependency) against a
live `aieng serve` of the bundled model, unchanged: no pooling field in its requests."""

from __future__ import annotations

import numpy as np
import pytest
from server_fixtures import MODEL_NAME, ThreadServer

from aieng.config.default_model import default_model_path

openai_embeddings = pytest.importorskip("llama_index.embeddings.openai")


@pytest.fixture(scope="module")
def server():
    with ThreadServer(default_model_path(), engine={"kv_cache_memory": 1 << 24}) as s:
        yield s
        s.wait_idle()
        s.in_engine(lambda engine: engine.check_pool_whole())


def test_openai_embedding_needs_no_pooling(server):
    embedder = openai_embeddings.OpenAIEmbedding(
        model_name=MODEL_NAME, api_base=f"{server.url}/v1", api_key="unused", max_retries=0
    )
    texts = ["In the beginning", "Jesus wept.", "And God said"]
    documents = np.array(embedder.get_text_embedding_batch(texts))
    query = np.array(embedder.get_query_embedding(texts[1]))
    assert documents.shape == (3, 256)
    np.testing.assert_allclose(np.linalg.norm(documents, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(query, documents[1], atol=1e-5)
