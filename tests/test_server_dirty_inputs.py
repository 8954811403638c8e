"""A fixed set of dirty inputs through /v1/completions and /v1/chat/completions, streaming and
not: a UTF-8 byte-order mark, NUL and other control characters, mixed scripts and emoji
(including joined and flag sequences), invalid-looking escapes, an over-long line, whitespace
only, and prompts past the model's context. Each gets a 200 with sane output or a 400 with an
OpenAI error body naming the problem — never a 5xx, a hang or a dropped connection — and after
all of them the server's accounting is whole: no request in flight, no KV block held."""

from __future__ import annotations

import json

import httpx
import pytest
from server_fixtures import MODEL_NAME, ThreadServer, make_model_dir

CONTEXT = 512  # the tiny model's max_position_embeddings

DIRTY_PROMPTS = {
    "bom": "\ufeffAnd God said",
    "bom_only": "\ufeff",
    "nul": "a\x00b\x00\x00c",
    "controls": "\x01\x02\x07\x08\x1b[31mred\x1b[0m\x7f\r\n\t\x0b\x0c",
    "mixed_scripts": "Hello мир 世界 مرحبا שלום नमस्ते こんにちは 안녕",
    "emoji": "👩‍👩‍👧‍👦 🏳️‍🌈 🇺🇳 ❤️ 🧑🏽‍💻 \U0001f600" * 3,
    "combining": "e\u0301\u0302\u0303 Z\u0336\u0337a\u0338l\u0335g\u0334o",
    "rtl_override": "abc\u202edcba\u202c \u200b\u200d\ufeff",
    "escapes_as_text": "\\u0000 \\ud800 %00 &#0; \\x00",
    "private_use_and_nonchars": "\ue000\U000f0000\ufffe\uffff\ufffd",
    "whitespace_only": " \t\n \u3000\u00a0",
    "long_line_within_context": "x" * 150,
    "past_the_context": "word " * (CONTEXT * 2),
    "far_past_the_context": "y" * 200_000,
}
PAST_CONTEXT = {"past_the_context", "far_past_the_context"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_model_dir(tmp_path_factory.mktemp("dirty"), max_positions=CONTEXT)
    with ThreadServer(model) as s:
        yield s
        s.wait_idle()
        assert s.ctx.admission.num_in_flight == 0
        s.in_engine(lambda engine: engine.check_pool_whole())


def check_answer(response: httpx.Response, name: str, chat: bool) -> None:
    assert response.status_code in (200, 400), (name, response.status_code, response.text)
    body = response.json()
    if response.status_code == 400:
        error = body["error"]
        assert error["type"] == "invalid_request_error" and error["message"], body
        assert name in PAST_CONTEXT, f"{name} refused: {error['message']}"
        assert "context" in error["message"] or "tokens" in error["message"], error
        return
    assert name not in PAST_CONTEXT, f"{name} past the context was accepted"
    [choice] = body["choices"]
    text = choice["message"]["content"] if chat else choice["text"]
    assert isinstance(text, str)
    text.encode("utf-8")  # well-formed: no lone surrogates reach the client
    assert choice["finish_reason"] in ("stop", "length")
    assert body["usage"]["completion_tokens"] <= 8


def request_body(prompt: str, chat: bool, stream: bool) -> dict:
    body: dict = {"model": MODEL_NAME, "max_tokens": 8, "temperature": 0, "stream": stream}
    if chat:
        body["messages"] = [
            {"role": "system", "content": prompt},
            {"role": "user", "content": prompt},
        ]
    else:
        body["prompt"] = prompt
    return body


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("name", sorted(DIRTY_PROMPTS))
def test_dirty_input_gets_an_answer_or_a_clear_400(server, name, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = request_body(DIRTY_PROMPTS[name], chat, stream=False)
    check_answer(httpx.post(server.url + path, json=body, timeout=60), name, chat)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("name", ["bom", "nul", "emoji", "combining", "past_the_context"])
def test_dirty_input_streams_whole_events_or_a_clear_400(server, name, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = request_body(DIRTY_PROMPTS[name], chat, stream=True)
    with httpx.stream("POST", server.url + path, json=body, timeout=60) as response:
        if name in PAST_CONTEXT:
            response.read()
            assert response.status_code == 400, response.text
            assert response.json()["error"]["type"] == "invalid_request_error"
            return
        assert response.status_code == 200
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    text = ""
    for event in events[:-1]:
        chunk = json.loads(event.removeprefix("data: "))
        assert "error" not in chunk, chunk
        for choice in chunk["choices"]:
            text += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
    text.encode("utf-8")


def test_dirty_inputs_through_tokenize_round_trip(server):
    for name, prompt in DIRTY_PROMPTS.items():
        if name in PAST_CONTEXT:
            continue
        tokens = httpx.post(f"{server.url}/tokenize", json={"model": MODEL_NAME, "prompt": prompt})
        assert tokens.status_code == 200, (name, tokens.text)
        ids = tokens.json()["tokens"]
        text = httpx.post(f"{server.url}/detokenize", json={"model": MODEL_NAME, "tokens": ids})
        assert text.status_code == 200, (name, text.text)
        assert text.json()["prompt"] == prompt, name  # byte-level BPE: lossless
