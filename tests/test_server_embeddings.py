"""`POST /v1/embeddings` through the openai client: the vectors equal sentence-transformers',
every input shape (string, strings, token ids, lists of them), float and base64, `dimensions`,
usage and metrics; bad inputs answer 400 naming the field; admission control refuses past the
queue limit; every KV block comes back."""

import argparse

import httpx
import numpy as np
import openai
import pytest
from embedding_fixtures import save_sentence_transformer
from server_fixtures import MODEL_NAME, SubprocessServer, ThreadServer, make_model_dir

TEXTS = ["In the beginning God created the heaven and the earth.", "Jesus wept.", "And God said"]


@pytest.fixture(scope="module")
def st_folder(tmp_path_factory):
    return save_sentence_transformer("bert", tmp_path_factory.mktemp("bert"))


@pytest.fixture(scope="module")
def server(st_folder):
    with ThreadServer(st_folder, max_queue_requests=4) as s:
        yield s
        s.wait_idle()
        s.in_engine(lambda engine: engine.check_pool_whole())


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def _post(server, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/embeddings", json={"model": MODEL_NAME, **body}, timeout=60)


def _assert_400(response: httpx.Response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error["message"]


def test_embeddings_equal_sentence_transformers(server, client, st_folder):
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(st_folder), device="cpu").encode(TEXTS)
    before = server.metrics()
    for encoding in ({}, {"encoding_format": "float"}):  # the client's default: base64
        response = client.embeddings.create(model=MODEL_NAME, input=TEXTS, **encoding)
        got = np.array([d.embedding for d in response.data], np.float32)
        assert [d.index for d in response.data] == [0, 1, 2]
        cosines = (got * reference).sum(1) / np.linalg.norm(got, axis=1)
        assert cosines.min() >= 0.9999, cosines
    ids = server.in_engine(lambda engine: engine.tokenizer.encode_batch(TEXTS, True))
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(map(len, ids))
    by_ids = client.embeddings.create(model=MODEL_NAME, input=ids)
    np.testing.assert_allclose([d.embedding for d in by_ids.data], got, atol=1e-5)
    one = client.embeddings.create(model=MODEL_NAME, input=ids[1])
    np.testing.assert_allclose(one.data[0].embedding, got[1], atol=1e-5)
    short = client.embeddings.create(model=MODEL_NAME, input=TEXTS[0], dimensions=16)
    head = got[0][:16] / np.linalg.norm(got[0][:16])
    np.testing.assert_allclose(short.data[0].embedding, head, atol=1e-5)
    after = server.wait_idle()
    assert after["aieng_prompt_tokens_total"] > before["aieng_prompt_tokens_total"]
    route = "aieng_http_requests_total{route=/v1/embeddings,status=200}"
    assert after[route] - before.get(route, 0) == 5


@pytest.mark.parametrize(
    "body, param",
    [
        (dict(input=""), "input"),
        (dict(input=["ok", ""]), "input"),
        (dict(input=[]), "input"),
        (dict(input=[[1, 2], []]), "input"),
        (dict(input=[5000]), "input"),  # outside the vocabulary
        (dict(input="word " * 200), "input"),  # past the context of 128 tokens
        (dict(input="x", dimensions=65), "dimensions"),
        (dict(input="x", dimensions=0), "dimensions"),
        (dict(input="x", encoding_format="int8"), "encoding_format"),
        (dict(input="x", pooling="max"), "pooling"),
    ],
)
def test_bad_inputs_name_the_field(server, body, param):
    _assert_400(_post(server, **body), param)


def test_admission_refuses_past_the_queue(server):
    """max_queue_requests=4: a request of five inputs can never be admitted."""
    response = _post(server, input=["a", "b", "c", "d", "e"])
    assert response.status_code == 400 and "queues at most 4" in response.text, response.text
    assert server.metrics()["aieng_request_rejected_total"] >= 1


def test_encoder_does_not_generate(server):
    response = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2},
        timeout=60,
    )
    assert response.status_code == 400 and "no LM head" in response.json()["error"]["message"]


def test_generation_only_model_needs_a_pooling(tmp_path):
    with ThreadServer(make_model_dir(tmp_path / "llama")) as llama:
        message = _assert_400(_post(llama, input="hello"), "pooling")
        assert "declares no pooling" in message
        ok = _post(llama, input=["hello", "world"], pooling="mean").json()
        vectors = np.array([d["embedding"] for d in ok["data"]])
        np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
        llama.wait_idle()
        llama.in_engine(lambda engine: engine.check_pool_whole())


def test_bundled_model_embeds_for_a_stock_client(tmp_path):
    """`aieng serve` with no model: the openai client's plain `embeddings.create` (no pooling
    field) gets the bundled model's mean-pooled, normalised vectors."""
    with SubprocessServer(None, tmp_path / "serve.log", "--max-model-len", "128") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        one = client.embeddings.create(model="aieng-kjv-6m", input="In the beginning")
        many = client.embeddings.create(model="aieng-kjv-6m", input=TEXTS)
        assert one.model == "aieng-kjv-6m" and len(one.data[0].embedding) == 256
        vectors = np.array([d.embedding for d in many.data])
        np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
        explicit = _post(server, model="aieng-kjv-6m", input=TEXTS, pooling="mean").json()
        np.testing.assert_allclose(vectors, [d["embedding"] for d in explicit["data"]], atol=1e-5)


def test_server_pooling_default_embeds_a_model_without_one(tmp_path):
    """The engine's `pooling` (`aieng serve --pooling last`) for a checkpoint declaring none."""
    from aieng.config.cli_args import engine_args
    from aieng.server.cli import add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert engine_args(parser.parse_args(["--pooling", "last"])).pooling == "last"
    with pytest.raises(SystemExit):
        parser.parse_args(["--pooling", "max"])
    with ThreadServer(make_model_dir(tmp_path / "llama"), engine=dict(pooling="last")) as llama:
        client = openai.OpenAI(base_url=f"{llama.url}/v1", api_key="unused", max_retries=0)
        got = client.embeddings.create(model=MODEL_NAME, input=TEXTS)
        explicit = _post(llama, input=TEXTS, pooling="last").json()
        np.testing.assert_allclose(
            [d.embedding for d in got.data], [d["embedding"] for d in explicit["data"]], atol=1e-5
        )
