"""A large body whose text can never fit the model is refused before Python parses it (issue
37): the core scans it with the GIL released and the answer is the one the route gives after
parsing (json.loads of a 4 MB body holds the GIL tens of milliseconds and stalls the engine's
steps). The scan never refuses a body that could fit, and leaves what it cannot judge to the
usual path."""

import asyncio
import json

import httpx
import pytest
from server_fixtures import ThreadServer, make_model_dir
from starlette.requests import ClientDisconnect, Request

from aieng.server import offloop, oversize
from aieng.server.tokenizing import longest_token_bytes

BIG = offloop.OFF_LOOP_BYTES + 1000  # a body this long goes to the parsing pool


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def server(model):
    with ThreadServer(model, engine={"max_model_len": 256}) as s:
        yield s
        s.wait_idle()
        s.in_engine(lambda engine: engine.check_pool_whole())


@pytest.fixture
def big_loads(monkeypatch):
    """The bodies past OFF_LOOP_BYTES that json.loads parsed, counted."""
    calls: list[int] = []
    loads = json.loads

    def counted(text, *args, **kwargs):
        if len(text) > offloop.OFF_LOOP_BYTES:
            calls.append(len(text))
        return loads(text, *args, **kwargs)

    monkeypatch.setattr(offloop.json, "loads", counted)
    return calls


def _limit(server: ThreadServer, path: str) -> int:
    """The most UTF-8 bytes a text of the route can have and still perhaps fit."""
    per_token = server.in_engine(lambda engine: longest_token_bytes(engine.tokenizer)) + 4
    room = oversize.TEXT_FIELDS[path][1]
    return (server.ctx.engine.model_info.max_model_len - room) * per_token


def _post(server: ThreadServer, path: str, body: dict, pad: int = 0) -> tuple[int, dict]:
    content = json.dumps(body).encode() + b" " * pad  # JSON may end in white space
    assert len(content) > offloop.OFF_LOOP_BYTES
    response = httpx.post(
        f"{server.url}{path}",
        content=content,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    return response.status_code, response.json()


def _unscanned(server, path, body, monkeypatch, pad: int = 0) -> tuple[int, dict]:
    """The answer the route gives the same body parsed as before (the scan finds nothing)."""
    with monkeypatch.context() as m:
        m.setattr(oversize, "oversize_text", lambda body, field, limit: None)
        return _post(server, path, body, pad)


ROUTES = [
    ("/v1/completions", "prompt", {}),
    ("/v1/embeddings", "input", {"pooling": "mean"}),
    ("/tokenize", "prompt", {}),
]


@pytest.mark.parametrize(("path", "field", "extra"), ROUTES)
def test_an_oversize_text_is_refused_unparsed_with_the_routes_own_answer(
    server, big_loads, monkeypatch, path, field, extra
):
    body = {field: "é" * BIG, **extra}
    status, answer = _post(server, path, body)
    assert status == 400, answer
    assert answer["error"]["code"] == "context_length_exceeded"
    assert f"{2 * BIG} bytes of text" in answer["error"]["message"]
    assert big_loads == []  # never parsed in Python
    assert _unscanned(server, path, body, monkeypatch) == (status, answer)
    assert len(big_loads) == 1  # the usual path parsed it, and answered the same


def test_a_list_names_its_first_text_past_the_bound(server, big_loads, monkeypatch):
    body = {"input": ["short", "a" * BIG, "b" * BIG], "pooling": "mean"}
    status, answer = _post(server, "/v1/embeddings", body)
    assert status == 400 and answer["error"]["message"].startswith(f"input 1 is {BIG} bytes")
    assert big_loads == []
    assert _unscanned(server, "/v1/embeddings", body, monkeypatch) == (status, answer)


def test_an_unknown_model_is_still_a_404_first(server, big_loads, monkeypatch):
    body = {"model": "no-such-model", "prompt": "a" * BIG}
    status, answer = _post(server, "/v1/completions", body)
    assert status == 404, answer
    assert _unscanned(server, "/v1/completions", body, monkeypatch) == (status, answer)


@pytest.mark.parametrize(("path", "field", "extra"), ROUTES)
def test_a_text_at_the_bound_is_parsed_and_judged_as_before(
    server, big_loads, monkeypatch, path, field, extra
):
    limit = _limit(server, path)
    text = ("a " * limit)[:limit]  # at the bound, and long in tokens
    body = {field: text, **extra}
    status, answer = _post(server, path, body, pad=BIG)  # a large body, a short enough text
    assert len(big_loads) == 1  # the scan passed it on to be parsed
    if path == "/tokenize":  # counted, however many tokens
        assert status == 200 and answer["count"] > answer["max_model_len"], answer
    else:  # judged by its tokens, not its bytes
        assert status == 400, answer
        assert "bytes of text" not in answer["error"]["message"]
        assert "tokens" in answer["error"]["message"]
    assert _unscanned(server, path, body, monkeypatch, pad=BIG) == (status, answer)


def test_a_large_body_that_fits_is_served(server, big_loads):
    body = {"prompt": "In the beginning", "max_tokens": 2, "user": "x" * BIG}
    status, answer = _post(server, "/v1/completions", body)  # a long field not scanned
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] == 2
    assert len(big_loads) == 1


@pytest.mark.parametrize("path", ["/tokenize", "/v1/completions"])
def test_a_body_near_the_byte_limit_with_a_short_prompt_is_served(server, path):
    """JSON may hold any amount of white space, so no route has a bound on its body's bytes
    below the server's limit (`--max-body-bytes`): refusing by Content-Length before reading
    a body would refuse requests like these, which are served."""
    body = {"prompt": "In the beginning", **({"max_tokens": 1} if path != "/tokenize" else {})}
    size = len(json.dumps(body))
    status, answer = _post(server, path, body, pad=server.ctx.config.max_body_bytes - size)
    assert status == 200, answer
    assert (answer["count"] if path == "/tokenize" else answer["usage"]["prompt_tokens"]) > 0


def test_what_strict_json_does_not_take_is_left_to_the_usual_path(server, big_loads):
    # A lone surrogate: Python's json takes it, the protocol refuses it by name.
    content = b'{"prompt": "\\ud800' + b"a" * BIG + b'"}'
    response = httpx.post(
        f"{server.url}/v1/completions",
        content=content,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 400, response.text
    assert "bytes of text" not in response.json()["error"]["message"]
    assert len(big_loads) == 1


def _request(messages: list[dict]) -> Request:
    async def receive() -> dict:
        return messages.pop(0)

    return Request({"type": "http", "method": "POST", "headers": []}, receive)


def test_a_body_in_one_message_is_not_copied():
    body = b"x" * BIG
    request = _request([{"type": "http.request", "body": body, "more_body": False}])
    assert asyncio.run(offloop.whole_body(request)) is body
    assert asyncio.run(request.body()) is body  # what FastAPI reads next


def test_a_body_in_parts_is_joined_and_a_disconnect_is_raised():
    parts = [{"type": "http.request", "body": b"ab", "more_body": True}]
    request = _request([*parts, {"type": "http.request", "body": b"cd", "more_body": False}])
    assert asyncio.run(offloop.whole_body(request)) == b"abcd"
    request = _request([*parts, {"type": "http.disconnect"}])
    with pytest.raises(ClientDisconnect):
        asyncio.run(offloop.whole_body(request))
