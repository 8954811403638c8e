"""What real clients send and expect (issue 13, items 2, 5 and 6 in part): unknown fields
ignored and reported, continuous usage in streams, `GET /v1/models/{id}`, `/version`, `HEAD`
probes, streamed `text_offset`, the CORS preflight of the openai JS client, and hostile input
(huge integers, lone surrogates) answered 400 with an OpenAI error body, never a 500 that
echoes an exception."""

import json
import logging

import httpx
import openai
import pytest
from server_fixtures import MODEL_NAME, ThreadServer, make_model_dir

import aieng
from aieng.server import completions

GREEDY = dict(temperature=0, max_tokens=8, extra_body={"ignore_eos": True})
MESSAGES = [{"role": "user", "content": "The quick brown fox"}]
IGNORED = "x-aieng-ignored-fields"
ANY = object()  # any param


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def server(model):
    with ThreadServer(model) as s:
        yield s
        s.wait_idle()
        s.in_engine(lambda engine: engine.check_pool_whole())


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def assert_openai_error(response: httpx.Response, status: int, param: object = ANY) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert param is ANY or body["error"]["param"] == param, body
    for internal in ("Traceback", "Error:", "Exception", 'File "'):
        assert internal not in body["error"]["message"], body
    return body["error"]


def raw_post(url: str, raw: str) -> httpx.Response:
    """Posts JSON text as given (json.dumps would escape, or refuse, what a test needs)."""
    return httpx.post(url, content=raw.encode(), headers={"content-type": "application/json"})


# ---------------------------------------------------------------- item 2: unknown fields


def test_unknown_fields_are_ignored_listed_and_logged_once(server, client, caplog):
    caplog.set_level(logging.WARNING, logger="aieng.server.params")
    extra = {"store": True, "metadata": {"k": "v"}, "ignore_eos": True}
    for _ in range(2):
        raw = client.completions.with_raw_response.create(
            model=MODEL_NAME, prompt="The", temperature=0, max_tokens=3, extra_body=extra
        )
        assert raw.headers[IGNORED] == "store,metadata"
        assert raw.parse().usage.completion_tokens == 3
    warned = [r.getMessage() for r in caplog.records if "unknown request field" in r.message]
    assert sum("'store'" in m for m in warned) == 1
    assert sum("'metadata'" in m for m in warned) == 1
    known = httpx.post(
        f"{server.url}/v1/completions", json={"prompt": "The", "max_tokens": 2, "seed": 1}
    )
    assert known.status_code == 200 and IGNORED not in known.headers


def test_chat_accepts_what_langchain_and_guidellm_send(client):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        store=False,
        metadata={"run": "1"},
        parallel_tool_calls=False,
        response_format={"type": "text"},
        **GREEDY,
    )
    # response_format and parallel_tool_calls are known (structured outputs, tool calling)
    assert set(raw.headers[IGNORED].split(",")) == {"store", "metadata"}
    assert raw.parse().choices[0].message.content
    stream = client.chat.completions.with_raw_response.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True, "future_option": 1},
        temperature=0,
        max_tokens=4,
    )
    assert stream.headers[IGNORED] == "future_option"
    assert list(stream.parse())[-1].usage.completion_tokens == 4


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("functions", [{"name": "f", "parameters": {}}]),
        ("function_call", "auto"),
        ("guided_json", {"type": "object"}),
    ],
)
def test_known_but_unsupported_fields_are_still_refused(server, field, value):
    for path, body in (
        ("/v1/completions", {"prompt": "The"}),
        ("/v1/chat/completions", {"messages": MESSAGES}),
    ):
        response = httpx.post(f"{server.url}{path}", json={**body, field: value})
        error = assert_openai_error(response, 400, field)
        assert error["code"] == "unsupported_field" and field in error["message"]


@pytest.mark.parametrize("include_usage", [True, False])
def test_continuous_usage_stats_put_usage_in_every_chunk(client, include_usage):
    options = {"include_usage": include_usage, "continuous_usage_stats": True}
    chunks = list(
        client.completions.create(
            model=MODEL_NAME, prompt="The", stream=True, stream_options=options, **GREEDY
        )
    )
    assert chunks and all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 8
    assert all(
        c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks
    )
    assert (chunks[-1].choices == []) is include_usage  # the usage-only last chunk


# ---------------------------------------------------------------- item 5: smaller gaps


def test_retrieve_a_model_and_a_missing_one(server, client):
    model = client.models.retrieve(MODEL_NAME)
    assert model.id == MODEL_NAME and model.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    error = assert_openai_error(httpx.get(f"{server.url}/v1/models/no/such"), 404, "model")
    assert error["code"] == "model_not_found"


def test_version_and_head_probes(server):
    assert httpx.get(f"{server.url}/version").json() == {"version": aieng.__version__}
    for path in ("/health", "/ready"):
        response = httpx.head(f"{server.url}{path}")
        assert response.status_code == 200 and response.content == b""


def test_streamed_text_offsets_count_through_the_text(client):
    kwargs = dict(model=MODEL_NAME, prompt="The quick brown fox", logprobs=2, **GREEDY)
    whole = client.completions.create(**kwargs).choices[0].logprobs
    assert whole.text_offset[0] == 0 and len(whole.text_offset) == 8
    offsets, tokens = [], []
    for chunk in client.completions.create(stream=True, **kwargs):
        if chunk.choices and chunk.choices[0].logprobs:
            offsets += chunk.choices[0].logprobs.text_offset
            tokens += chunk.choices[0].logprobs.tokens
    assert tokens == whole.tokens
    assert offsets == whole.text_offset
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


STAINLESS = (
    "authorization, content-type, x-stainless-arch, x-stainless-lang, x-stainless-os, "
    "x-stainless-package-version, x-stainless-retry-count, x-stainless-runtime, "
    "x-stainless-runtime-version, x-stainless-timeout, x-stainless-helper-method"
)


def test_cors_preflight_of_the_openai_js_client(model):
    origin = "http://app.example"
    with ThreadServer(model, api_key="k", allowed_origins=(origin,)) as s:
        preflight = {
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": STAINLESS,
        }
        response = httpx.options(f"{s.url}/v1/chat/completions", headers=preflight)
        assert response.status_code == 200, response.text
        assert response.headers["access-control-allow-origin"] == origin
        allowed = response.headers["access-control-allow-headers"].lower()
        for name in STAINLESS.split(", "):
            assert name in allowed
        other = httpx.options(
            f"{s.url}/v1/chat/completions", headers={**preflight, "Origin": "http://evil.example"}
        )
        assert other.status_code == 400
    with ThreadServer(model, allowed_origins=("*",)) as s:
        response = httpx.options(f"{s.url}/v1/completions", headers=preflight)
        assert response.status_code == 200, response.text
        assert response.headers["access-control-allow-origin"] == "*"
        assert "x-stainless-timeout" in response.headers["access-control-allow-headers"].lower()


# ---------------------------------------------------------------- item 6: hostile input


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        ("/v1/completions", '{"prompt": "a", "top_k": 9223372036854775808}', "top_k"),
        ("/v1/completions", '{"prompt": "a", "top_k": 4294967296}', "top_k"),
        ("/v1/completions", '{"prompt": "a", "min_tokens": 18446744073709551616}', "min_tokens"),
        ("/v1/completions", '{"prompt": "a", "stop_token_ids": [9223372036854775808]}', None),
        ("/v1/completions", '{"prompt": [1, 9223372036854775808]}', None),
        ("/v1/completions", '{"prompt": "a", "stop": "\\ud800"}', "stop"),
        ("/v1/completions", '{"prompt": "a", "stop": ["ok", "\\udfff"]}', None),
        ("/v1/completions", '{"prompt": "\\ud800"}', "prompt"),
        ("/v1/completions", '{"prompt": "a", "model": "\\ud800"}', "model"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', None),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": [{"type": "text", "text": "x\\ud800"}]}]}',
            None,
        ),
        ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
        ("/tokenize", '{"messages": [{"role": "user", "content": "\\udc00"}]}', None),
    ],
)
def test_hostile_values_get_400(server, path, raw, param):
    error = assert_openai_error(raw_post(f"{server.url}{path}", raw), 400, param or ANY)
    assert error["type"] == "invalid_request_error"


def test_errors_never_echo_internal_exception_text(server, monkeypatch):
    async def broken(*_args, **_kwargs):
        raise RuntimeError("sekrit internal detail")

    monkeypatch.setattr(completions, "_prompt_ids", broken)
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "The"})
    assert response.status_code == 500
    error = response.json()["error"]
    assert "sekrit" not in response.text and error["code"] == "internal"
    assert response.headers["x-request-id"] in error["message"]
    monkeypatch.undo()

    engine = server.ctx.engine

    async def failing_stream(*_args, **_kwargs):
        raise KeyError("sekrit engine detail")
        yield  # an async generator

    monkeypatch.setattr(engine, "generate", failing_stream)
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "The"})
    assert response.status_code == 500 and "sekrit" not in response.text
    assert json.loads(response.text)["error"]["type"] == "server_error"


def test_odd_unknown_field_names_stay_out_of_the_header(server):
    many = ",".join(f'"f{i}": {i}' for i in range(100))
    raw = '{"prompt": "The", "max_tokens": 2, "a\\r\\nb": 1, "\\u00e9": 2, ' + many + "}"
    response = raw_post(f"{server.url}/v1/completions", raw)
    assert response.status_code == 200, response.text
    names = response.headers[IGNORED].split(",")
    assert names == [f"f{i}" for i in range(32)]
    surrogate = '{"prompt": "The", "\\ud800": 1}'
    assert_openai_error(raw_post(f"{server.url}/v1/completions", surrogate), 400)
