"""LiteLLM (a test dependency) against a live `aieng serve` of the bundled model, unchanged:
`litellm.completion` with tools forced (a plain function's schema, no bound on its string),
whole and streamed, and `litellm.embedding` with no pooling field. The `openai/` prefix sends
the OpenAI body as given."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from server_fixtures import MODEL_NAME, ThreadServer

from aieng.config.default_model import default_model_path
from aieng.server.tool_calls import DEFAULT_STRING_MAX_LENGTH

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download at import
litellm = pytest.importorskip("litellm")

WEATHER = {  # what LangChain and LiteLLM make of `def weather(city: str)`: an unbounded string
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    with ThreadServer(
        default_model_path(), engine={"kv_cache_memory": 1 << 24}, tool_call_parser="hermes"
    ) as s:
        yield s
        s.wait_idle()
        s.in_engine(lambda engine: engine.check_pool_whole())


def target(server) -> dict:
    return dict(model=f"openai/{MODEL_NAME}", api_base=f"{server.url}/v1", api_key="unused")


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "weather"}}]
)
def test_completion_with_forced_tools_gets_one_closed_call(server, tool_choice):
    reply = litellm.completion(
        **target(server),
        messages=ASK,
        tools=[WEATHER],
        tool_choice=tool_choice,
        temperature=1.3,
        seed=3,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    city = json.loads(call.function.arguments)["city"]
    assert call.function.name == "weather" and len(city) <= DEFAULT_STRING_MAX_LENGTH


def test_streamed_completion_with_tools(server):
    chunks = litellm.completion(
        **target(server), messages=ASK, tools=[WEATHER], tool_choice="required", stream=True,
        temperature=1.3, seed=3,
    )  # fmt: skip
    names, arguments, finish = [], "", None
    for chunk in chunks:
        choice = chunk.choices[0]
        for part in choice.delta.tool_calls or []:
            if part.function.name:
                names.append(part.function.name)
            arguments += part.function.arguments or ""
        finish = choice.finish_reason or finish
    assert names == ["weather"] and finish == "tool_calls"
    assert set(json.loads(arguments)) == {"city"}


def test_embedding_needs_no_pooling(server):
    texts = ["In the beginning", "Jesus wept."]
    reply = litellm.embedding(**target(server), input=texts)
    vectors = np.array([d["embedding"] for d in reply.data])
    assert vectors.shape == (2, 256)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
