"""Server edge cases (issue 22, items 6 and 7): a trickling body ends with 408 at its whole-body
deadline and frees its place, one client cannot hold every body-read place, a negative token id
in a prompt is a 400 naming it, an unknown model (or version) is 404 `model_not_found`, a cut
tool call is neither a call nor content and a parallel-call grammar lets the model stop, and
loading a version whose folder was removed says so."""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import time
from pathlib import Path

import httpx
import pytest
from server_fixtures import MODEL_NAME, VOCAB, ThreadServer, make_model_dir
from text_fixtures import byte_level_bpe, save_model_dir
from tiny_models import build_checkpoint

from aieng.config.default_model import default_model_path
from aieng.server.cli import add_serve_arguments, server_config
from aieng.server.config import ServerConfig
from aieng.server.tool_parsers import HermesToolParser, ParsedCall

KEY = "sekrit"
AUTH = {"authorization": f"Bearer {KEY}"}
BODY_TIMEOUT = 1.0
TRICKLE_S = 0.2  # well inside the idle timeout: only the whole-body deadline can end it


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def server(model):
    with ThreadServer(
        model,
        api_key=KEY,
        request_read_timeout=10.0,
        request_body_timeout=BODY_TIMEOUT,
        max_concurrent_body_reads=4,
        max_body_reads_per_client=2,
    ) as s:
        yield s
        s.wait_idle()
        s.in_engine(lambda engine: engine.check_pool_whole())


def assert_error(response: httpx.Response, status: int, code: str, *words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    for word in words:
        assert word in error["message"], error
    return error


# ---------------------------------------------------------------- item 6: slow bodies


def connect(server: ThreadServer, source: str = "127.0.0.1") -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), 10, (source, 0))


def head(length: int) -> bytes:
    lines = ["POST /v1/completions HTTP/1.1", "host: x", "content-type: application/json"]
    lines += [f"content-length: {length}", f"authorization: {AUTH['authorization']}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def start_trickle(server: ThreadServer, source: str = "127.0.0.1") -> socket.socket:
    """A connection that announces 100000 bytes and sends its first; the caller trickles on."""
    sock = connect(server, source)
    sock.sendall(head(100_000) + b"{")
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def trickle_until_answered(socks: list[socket.socket], limit: float) -> list[tuple[int, bytes]]:
    """One byte to each socket every TRICKLE_S until each has an answer and is closed."""
    answers: dict[int, bytes] = {}
    closed: set[int] = set()
    end = time.monotonic() + limit
    for sock in socks:
        sock.settimeout(TRICKLE_S / len(socks))
    while len(closed) < len(socks) and time.monotonic() < end:
        for i, sock in enumerate(socks):
            if i in closed:
                continue
            try:
                if i not in answers:
                    sock.sendall(b" ")
                data = sock.recv(65536)
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                data = b""
            if data:
                answers[i] = answers.get(i, b"") + data
            else:
                closed.add(i)
    assert len(closed) == len(socks), f"still open after {limit} s: {answers}"
    return [(int(answers[i].split(b" ", 2)[1]), answers[i]) for i in range(len(socks))]


def complete(server: ThreadServer, **body) -> httpx.Response:
    body = {"prompt": "hi", "max_tokens": 2, **body}
    return httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=30)


def test_a_trickling_body_gets_408_at_its_deadline(server):
    """One byte every 0.2 s never trips the idle timeout (10 s); the whole-body deadline (1 s)
    ends it with an OpenAI-style 408 and closes the connection."""
    start = time.monotonic()
    with start_trickle(server) as sock:
        [(status, data)] = trickle_until_answered([sock], BODY_TIMEOUT + 5)
    elapsed = time.monotonic() - start
    assert status == 408, data
    assert BODY_TIMEOUT * 0.9 < elapsed < BODY_TIMEOUT + 2, elapsed
    error = json.loads(data.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == "request_timeout" and error["type"] == "invalid_request_error"
    assert "did not arrive in full within 1 s" in error["message"]
    assert complete(server).status_code == 200


def test_one_client_cannot_hold_every_body_slot(server):
    """A client trickling bodies holds at most its 2 places (its third gets 429 at once), so
    another client's body is still read; once the trickles pass their deadline their places
    are free again."""
    key = "aieng_request_rejected_total{reason=too_many_uploads_from_client}"
    counted = server.metrics().get(key, 0.0)
    held = [start_trickle(server) for _ in range(2)]
    try:
        time.sleep(0.2)
        with start_trickle(server) as third:
            data = read_until_closed(third)
            assert data.startswith(b"HTTP/1.1 429"), data
            assert b"too_many_uploads_from_client" in data and b"retry-after: 1" in data
        # the refusal is in the server's refusal counter, as every refusal a client sees
        assert server.metrics().get(key, 0.0) == counted + 1
        other = connect(server, "127.0.0.2")  # another peer address on the loopback
        with other:
            body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
            other.sendall(head(len(body)) + body)
            assert other.recv(65536).startswith(b"HTTP/1.1 200"), "the other client was refused"
        answers = trickle_until_answered(held, BODY_TIMEOUT + 5)
        assert [status for status, _ in answers] == [408, 408]
    finally:
        for sock in held:
            sock.close()
    for _ in range(3):  # more than the per-client cap: every place was freed
        assert complete(server).status_code == 200


def test_the_body_options_and_their_flags():
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    config = server_config(parser.parse_args([]), Path("m"))
    assert config.request_body_timeout == 30.0 and config.max_body_reads_per_client == 16
    args = ["--request-body-timeout", "0", "--max-body-reads-per-client", "0"]
    config = server_config(parser.parse_args(args), Path("m"))
    assert config.request_body_timeout is None and config.max_body_reads_per_client is None
    with pytest.raises(ValueError, match="request_body_timeout must be > 0"):
        ServerConfig(served_model_name="m", request_body_timeout=-1.0)
    with pytest.raises(ValueError, match="max_body_reads_per_client must be >= 1"):
        ServerConfig(served_model_name="m", max_body_reads_per_client=0)


# ---------------------------------------------------------------- item 7: prompts and models


@pytest.mark.parametrize("prompt", [[-1], [[3, 4], [5, -7]]])
def test_a_negative_token_id_in_a_prompt_is_a_400_naming_it(server, prompt):
    bad = min(t for p in (prompt if isinstance(prompt[0], list) else [prompt]) for t in p)
    error = assert_error(
        complete(server, prompt=prompt), 400, "invalid_value", f"token id {bad}", "vocabulary"
    )
    assert error["param"] == "prompt" and ">= 0" in error["message"]


@pytest.mark.parametrize("name", ["gpt-9", f"{MODEL_NAME}@1.0.0"])
def test_an_unknown_model_is_404_model_not_found(server, name):
    for path, body in (
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        response = httpx.post(
            f"{server.url}{path}", json={**body, "model": name}, headers=AUTH, timeout=30
        )
        error = assert_error(response, 404, "model_not_found", repr(name), repr(MODEL_NAME))
        assert error["param"] == "model"


def version_folder(root: Path, version: str, tokenizer_from: Path | None = None) -> Path:
    folder = root / f"v{version}"
    if tokenizer_from is None:
        save_model_dir(folder, byte_level_bpe(VOCAB))
    else:
        folder.mkdir(parents=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer_from / name, folder / name)
    build_checkpoint("llama", folder, vocab_size=VOCAB)
    manifest = {"name": MODEL_NAME, "version": version}
    (folder / "aieng-model.json").write_text(json.dumps(manifest))
    return folder


def test_versions_unknown_or_removed_are_404(tmp_path):
    first = version_folder(tmp_path, "1.0.0")
    removed = version_folder(tmp_path, "1.1.0", tokenizer_from=first)
    with ThreadServer(first, model_dir=str(tmp_path), admin_key="admin-secret") as s:
        for name in ("other-model", f"{MODEL_NAME}@9.9.9", f"{MODEL_NAME}@1.1.0"):
            response = httpx.post(
                f"{s.url}/v1/completions",
                json={"model": name, "prompt": "hi", "max_tokens": 2},
                timeout=30,
            )
            assert_error(response, 404, "model_not_found", repr(name))
        shutil.rmtree(removed)
        response = httpx.post(
            f"{s.url}/admin/models/{MODEL_NAME}/load",
            json={"version": "1.1.0"},
            headers={"authorization": "Bearer admin-secret"},
            timeout=10,
        )
        assert_error(response, 404, "version_folder_missing", str(removed), "is gone")
        served = httpx.post(
            f"{s.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30
        )
        assert served.headers["x-aieng-model-version"] == "1.0.0"


# ---------------------------------------------------------------- item 7: cut tool calls

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>'
ADD_CALL = ParsedCall("add", '{"a": 2}')


@pytest.mark.parametrize(
    "text",
    [
        f'{CALL}\n<tool_call>\n{{"name": "ad',
        f"{CALL}\n<tool_c",
        f"{CALL}\n{CALL[:-3]}",
    ],
)
def test_a_call_cut_by_the_length_limit_is_neither_a_call_nor_content(text):
    parser = HermesToolParser()
    for pieces in ([text], list(text)):
        stream = parser.stream()
        outs = [stream.feed(piece) for piece in pieces] + [stream.finish(cut=True)]
        assert "".join(o.content for o in outs) == ""
        assert [c for o in outs for c in o.calls] == [ADD_CALL]
    assert parser.parse(text).content != ""  # ended by itself: the text is the model's content


ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["a"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def bundled():
    with ThreadServer(
        default_model_path(), engine={"kv_cache_memory": 1 << 24}, tool_call_parser="hermes"
    ) as s:
        yield s
        s.wait_idle()
        s.in_engine(lambda engine: engine.check_pool_whole())


def chat(server: ThreadServer, **extra) -> dict:
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Add two."}],
        "tools": [ADD],
        "tool_choice": "required",
        "temperature": 1.0,
        **extra,
    }
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def chat_stream(server: ThreadServer, **extra) -> tuple[str, list[dict], str | None]:
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Add two."}],
        "tools": [ADD],
        "tool_choice": "required",
        "temperature": 1.0,
        "stream": True,
        **extra,
    }
    content, calls, finish = "", {}, None
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json=body, timeout=60
    ) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                content += choice["delta"].get("content") or ""
                for part in choice["delta"].get("tool_calls") or []:
                    calls[part["index"]] = part["function"]
                finish = choice["finish_reason"] or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("max_tokens", [37, 61, 90])
def test_required_parallel_calls_cut_by_length_leave_no_markup(bundled, max_tokens):
    """parallel_tool_calls true (the model calls again and again): whatever the budget cuts,
    the complete calls are tool_calls and the content is empty, streamed or not."""
    choice = chat(bundled, max_tokens=max_tokens, seed=4, parallel_tool_calls=True)
    assert choice["finish_reason"] == "length"
    message = choice["message"]
    assert not message["content"], message  # None, or "" when no call was complete
    calls = [c["function"] for c in message.get("tool_calls") or []]
    for call in calls:
        assert call["name"] == "add" and 0 <= json.loads(call["arguments"])["a"] <= 99
    content, streamed, finish = chat_stream(
        bundled, max_tokens=max_tokens, seed=4, parallel_tool_calls=True
    )
    assert content == "" and finish == "length"
    assert [(c["name"], c["arguments"]) for c in streamed] == [
        (c["name"], c["arguments"]) for c in calls
    ]


def test_a_parallel_call_grammar_lets_the_model_stop(bundled):
    """EOS (ids 0 and 2) favoured: the grammar forbids it inside a call and allows it after
    one, so the output ends by itself after its first call."""
    choice = chat(
        bundled, max_tokens=200, seed=1, logit_bias={"0": 100, "2": 100}, parallel_tool_calls=True
    )
    assert choice["finish_reason"] == "tool_calls", choice
    assert len(choice["message"]["tool_calls"]) == 1 and choice["message"]["content"] is None
