"""LangChain's OpenAI client (langchain-openai, a test dependency) against a live `aieng serve`
of the bundled model, unchanged: `bind_tools` with a plain function (no bound on its string)
and with a pydantic model, forced by name and by "any" (required), whole and streamed; and
`OpenAIEmbeddings` with no pooling field."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pydantic import BaseModel, Field
from server_fixtures import MODEL_NAME, ThreadServer

from aieng.config.default_model import default_model_path
from aieng.server.tool_calls import DEFAULT_STRING_MAX_LENGTH

langchain_openai = pytest.importorskip("langchain_openai")


def weather(city: str) -> str:
    """The weather in a city."""
    return "sunny"


class Weather(BaseModel):
    """The weather in a city."""

    city: str = Field(max_length=20)


@pytest.fixture(scope="module")
def server():
    with ThreadServer(
        default_model_path(), engine={"kv_cache_memory": 1 << 24}, tool_call_parser="hermes"
    ) as s:
        yield s
        s.wait_idle()
        s.in_engine(lambda engine: engine.check_pool_whole())


def chat(server, **kwargs):
    return langchain_openai.ChatOpenAI(
        model=MODEL_NAME,
        base_url=f"{server.url}/v1",
        api_key="unused",
        max_retries=0,
        timeout=120,
        **kwargs,
    )


@pytest.mark.parametrize("tool_choice", ["weather", "any"])
@pytest.mark.parametrize("stream", [False, True], ids=["invoke", "stream"])
def test_bind_tools_with_a_plain_function_gets_one_closed_call(server, tool_choice, stream):
    bound = chat(server, temperature=1.3, seed=3).bind_tools([weather], tool_choice=tool_choice)
    if stream:
        message = None
        for chunk in bound.stream("Weather in Paris?"):
            message = chunk if message is None else message + chunk
    else:
        message = bound.invoke("Weather in Paris?")
    assert len(message.tool_calls) == 1, message
    (call,) = message.tool_calls
    assert call["name"] == "weather" and set(call["args"]) == {"city"}
    assert len(call["args"]["city"]) <= DEFAULT_STRING_MAX_LENGTH
    assert message.response_metadata.get("finish_reason") == "tool_calls"


def test_bind_tools_with_a_pydantic_model_keeps_its_bound(server):
    message = (
        chat(server, temperature=1.3, seed=3)
        .bind_tools([Weather], tool_choice="Weather")
        .invoke("Weather in Paris?")
    )
    (call,) = message.tool_calls
    assert call["name"] == "Weather" and len(Weather(**call["args"]).city) <= 20


def test_with_structured_output_parses(server):
    answer = (
        chat(server, temperature=0.7, seed=11)
        .with_structured_output(Weather, method="function_calling")
        .invoke("Weather in Paris?")
    )
    assert isinstance(answer, Weather)


def test_openai_embeddings_need_no_pooling(server):
    embeddings = langchain_openai.OpenAIEmbeddings(
        model=MODEL_NAME,
        base_url=f"{server.url}/v1",
        api_key="unused",
        max_retries=0,
        check_embedding_ctx_length=False,  # no tiktoken download: the texts go as they are
    )
    texts = ["In the beginning", "Jesus wept.", "And God said"]
    documents = np.array(embeddings.embed_documents(texts))
    query = np.array(embeddings.embed_query(texts[1]))
    assert documents.shape == (3, 256)
    np.testing.assert_allclose(np.linalg.norm(documents, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(query, documents[1], atol=1e-5)
    assert json.dumps(documents.tolist())  # plain floats
