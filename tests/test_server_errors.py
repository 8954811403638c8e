"""Bad input gets 400 (413 for a body too large, 401 without the API key) with an OpenAI error
body naming the problem; nothing a client sends raises a 5xx or disturbs the engine."""

import json
import threading
import time

import httpx
import openai
import pytest
from server_fixtures import MODEL_NAME, ThreadServer, make_model_dir, wait_ready

MAX_BODY = 64 << 10


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def server(model):
    with ThreadServer(model, max_body_bytes=MAX_BODY) as s:
        yield s
        s.wait_idle()
        s.in_engine(lambda engine: engine.check_pool_whole())


def assert_error(response: httpx.Response, status: int, param: str | None, *words: str) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and isinstance(error["type"], str)
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error
    return error


COMPLETION_CASES = [
    # (raw body or JSON object, param, words in the message)
    (b'{"prompt": "x",', None, ["not valid JSON"]),
    (b"[1, 2]", None, []),
    (b'{"prompt": "x", "temperature": NaN}', "temperature", ["finite"]),
    (b'{"prompt": "x", "top_p": Infinity}', "top_p", ["finite"]),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens", ["integer"]),
    ({"prompt": "x", "n": True}, "n", ["integer"]),
    ({"prompt": "x", "temperature": 3}, "temperature", ["2"]),
    ({"prompt": "x", "top_p": 0}, "top_p", []),
    ({"prompt": "x", "n": 0}, "n", []),
    ({"prompt": "x", "n": 17}, "n", ["16"]),
    ({"prompt": "x", "logprobs": 21}, "logprobs", ["20"]),
    # The engine's max_logprobs is the one limit (SamplingParams.verify), streaming or not.
    ({"prompt": "x", "logprobs": 21, "stream": True}, "logprobs", ["20", "max_logprobs"]),
    ({"prompt": "x", "presence_penalty": 5}, "presence_penalty", []),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens", []),
    ({"prompt": "x", "top_k": -2}, "top_k", []),
    ({"prompt": "x", "min_p": 2}, "min_p", []),
    ({"prompt": "x", "seed": 2**70}, "seed", []),
    ({"prompt": "x", "stop": ""}, "stop", ["non-empty"]),
    ({"prompt": "x", "stop": ["a"] * 17}, "stop", ["16"]),
    ({"prompt": "x", "min_tokens": 9, "max_tokens": 4}, "min_tokens", ["9", "4"]),
    ({"prompt": ""}, "prompt", ["empty"]),
    ({"prompt": []}, "prompt", ["empty"]),
    ({"prompt": [[]]}, "prompt", ["empty"]),
    ({"prompt": ["a", 1]}, "prompt", ["token ids"]),
    ({"prompt": [1, 99999]}, "prompt", ["99999", "vocabulary"]),
    ({"prompt": "The quick", "max_tokens": 2047}, "max_tokens", ["2048", "2047"]),
    ({"prompt": [5] * 2048}, "prompt", ["2048"]),
    ({"prompt": "x", "tools": [{"type": "function"}]}, "tools", ["unsupported"]),
    ({"prompt": "x", "echo": 1}, "echo", ["bool"]),
    ({"prompt": "x", "suffix": "y"}, "suffix", ["not supported"]),
    ({"prompt": "x", "logit_bias": {"abc": 1.0}}, "logit_bias", ["token ids"]),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias", ["[-100, 100]"]),
    ({"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias", ["99999", "vocabulary"]),
    ({"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids", []),
    ({"prompt": "x", "allowed_token_ids": [99999]}, "allowed_token_ids", ["99999", "vocabulary"]),
    ({"prompt": "x", "bad_words": "word"}, "bad_words", ["list"]),
    ({"prompt": "x", "best_of": 3}, "best_of", ["best_of"]),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", ["stream"]),
    ({"max_tokens": 3}, "prompt", ["missing"]),
]

CHAT_CASES = [
    ({"messages": []}, "messages", []),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role", []),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content", []),
    ({"messages": [{"role": "user"}]}, "messages.0.content", ["missing"]),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs", []),
    (
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
        "top_logprobs",
        ["20", "max_logprobs"],
    ),
    (
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4096},
        "max_completion_tokens",
        ["2048"],
    ),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"}, "tool_choice", []),
]


def _post(url: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(url, content=body, headers={"content-type": "application/json"})
    return httpx.post(url, json=body)


@pytest.mark.parametrize(("body", "param", "words"), COMPLETION_CASES)
def test_bad_completion_requests_get_400(server, body, param, words):
    assert_error(_post(f"{server.url}/v1/completions", body), 400, param, *words)


@pytest.mark.parametrize(("body", "param", "words"), CHAT_CASES)
def test_bad_chat_requests_get_400(server, body, param, words):
    assert_error(_post(f"{server.url}/v1/chat/completions", body), 400, param, *words)


def test_bad_tokenize_requests_get_400(server):
    both = {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}
    assert_error(httpx.post(f"{server.url}/tokenize", json=both), 400, "prompt", "exactly one")
    bad = httpx.post(f"{server.url}/detokenize", json={"tokens": [3, -1]})
    assert_error(bad, 400, "tokens.1", "greater than or equal to 0")
    past = httpx.post(f"{server.url}/detokenize", json={"tokens": [3, 99999]})
    assert_error(past, 400, "tokens", "99999", "vocabulary")


def test_large_bodies_get_413_and_odd_routes_are_errors(server):
    big = json.dumps({"prompt": "x" * MAX_BODY}).encode()
    assert_error(_post(f"{server.url}/v1/completions", big), 413, None, str(MAX_BODY))

    def chunked():  # no Content-Length: counted as it arrives
        for _ in range(5):
            yield b" " * (MAX_BODY // 4)

    response = httpx.post(f"{server.url}/v1/completions", content=chunked())
    assert_error(response, 413, None, "larger")
    assert_error(httpx.get(f"{server.url}/v1/nothing"), 404, None)
    assert_error(httpx.get(f"{server.url}/v1/completions"), 405, None)


def test_the_engine_keeps_serving_after_bad_input(server):
    for body, _, _ in COMPLETION_CASES[:10]:
        _post(f"{server.url}/v1/completions", body)
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "The", "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 3
    assert server.ctx.engine.alive


def test_cors_is_off_unless_asked_for(server):
    preflight = {"Origin": "http://a.example", "Access-Control-Request-Method": "POST"}
    response = httpx.options(f"{server.url}/v1/completions", headers=preflight)
    assert "access-control-allow-origin" not in response.headers


def test_api_key_and_cors_when_configured(model):
    with ThreadServer(model, api_key="sekret", allowed_origins=("http://a.example",)) as s:
        url = f"{s.url}/v1/completions"
        body = {"prompt": "The", "max_tokens": 2}
        assert_error(httpx.post(url, json=body), 401, None, "API key")
        wrong = httpx.post(url, json=body, headers={"Authorization": "Bearer sekreT"})
        assert_error(wrong, 401, None)
        assert wrong.headers["www-authenticate"] == "Bearer"
        for path in ("/tokenize", "/detokenize"):
            assert httpx.post(f"{s.url}{path}", json={"prompt": "x"}).status_code == 401
        for path in ("/health", "/ready", "/metrics"):
            assert httpx.get(f"{s.url}{path}").status_code == 200
        with openai.OpenAI(base_url=f"{s.url}/v1", api_key="sekret", max_retries=0) as client:
            out = client.completions.create(model=MODEL_NAME, prompt="The", max_tokens=2)
            assert out.usage.completion_tokens <= 2
        with openai.OpenAI(base_url=f"{s.url}/v1", api_key="nope", max_retries=0) as client:
            with pytest.raises(openai.AuthenticationError):
                client.models.list()
        preflight = {"Origin": "http://a.example", "Access-Control-Request-Method": "POST"}
        response = httpx.options(url, headers=preflight)
        assert response.headers["access-control-allow-origin"] == "http://a.example"


def test_while_the_model_loads_everything_answers_503(model):
    gate = threading.Event()
    with ThreadServer(model, loading_gate=gate) as s:
        deadline = time.monotonic() + 30
        while True:  # the listener is up before the model
            try:
                ready = httpx.get(f"{s.url}/ready")
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert ready.status_code == 503 and ready.json()["status"] == "starting"
        assert httpx.get(f"{s.url}/health").status_code == 503
        response = httpx.post(f"{s.url}/v1/completions", json={"prompt": "The", "max_tokens": 2})
        error = assert_error(response, 503, None, "loading")
        assert error["code"] == "starting" and response.headers["retry-after"] == "5"
        assert httpx.get(f"{s.url}/v1/models").status_code == 200
        gate.set()
        wait_ready(s.url)
        response = httpx.post(f"{s.url}/v1/completions", json={"prompt": "The", "max_tokens": 2})
        assert response.status_code == 200


def test_a_request_larger_than_the_kv_pool_gets_400(model):
    # 2 layers x 2 KV heads x 16 dims x 2 (K, V) x 2 bytes (bfloat16: the CPU's default cache)
    # x 4 tokens: 1 KiB a block; 40 blocks
    with ThreadServer(model, engine={"kv_cache_memory": 40 * 1024}) as s:
        body = {"prompt": "The quick brown fox", "max_tokens": 400}
        response = httpx.post(f"{s.url}/v1/completions", json=body)
        assert_error(response, 400, "prompt", "KV blocks", "40")
        ok = httpx.post(f"{s.url}/v1/completions", json={**body, "max_tokens": 8})
        assert ok.status_code == 200
        s.wait_idle()
        s.in_engine(lambda engine: engine.check_pool_whole())
