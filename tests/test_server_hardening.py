"""The server against hostile and slow clients (issue 13, item 6): the API key is checked
before any body is read, slow headers and bodies time out, concurrent body reads are bounded,
a huge chat body does not stall the event loop, and /ready follows a dead engine."""

import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from server_fixtures import ThreadServer, make_model_dir

from aieng.server.protocol import MAX_MESSAGES
from aieng.server.slow_clients import header_timeout_protocol

KEY = "sekrit"
AUTH = {"authorization": f"Bearer {KEY}"}
READ_TIMEOUT = 1.0


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("model"))


def hardened(model, **server) -> ThreadServer:
    """A ThreadServer run as `aieng serve` runs it: with the header timeout protocol."""
    s = ThreadServer(model, **server)
    s.server = uvicorn.Server(
        uvicorn.Config(
            s.app,
            host="127.0.0.1",
            port=s.port,
            log_config=None,
            http=header_timeout_protocol(READ_TIMEOUT),
        )
    )
    return s


@pytest.fixture(scope="module")
def server(model):
    with hardened(
        model, api_key=KEY, request_read_timeout=READ_TIMEOUT, max_concurrent_body_reads=2
    ) as s:
        yield s


def connect(server: ThreadServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    return sock


def head(path: str, length: int, headers: dict[str, str] | None = None) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "host: x", "content-type: application/json"]
    lines += [f"content-length: {length}"] + [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    """The status and whatever else arrived until the server closed or went quiet."""
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        if not chunk:
            break
        data += chunk
        if b"\r\n\r\n" in data:
            header, _, rest = data.partition(b"\r\n\r\n")
            length = next(
                (
                    int(line.split(b":")[1])
                    for line in header.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                ),
                None,
            )
            if length is not None and len(rest) >= length:
                break
    assert data, "the server closed the connection without an answer"
    return int(data.split(b" ", 2)[1]), data


def test_unauthenticated_request_refused_before_its_body_is_read(server):
    """Headers announcing 3.5 MiB and no body at all: 401 at once, not after the body."""
    with connect(server) as sock:
        sock.sendall(head("/v1/completions", int(3.5 * (1 << 20))))
        start = time.monotonic()
        status, data = read_response(sock)
        assert status == 401, data
        assert time.monotonic() - start < READ_TIMEOUT / 2
        assert b"invalid_api_key" in data
        assert sock.recv(1) == b""  # closed: the rest of the body is never read


def test_slow_body_gets_408(server):
    with connect(server) as sock:
        sock.sendall(head("/v1/completions", 1000, AUTH) + b'{"prompt": ')
        start = time.monotonic()
        status, data = read_response(sock)
        elapsed = time.monotonic() - start
        assert status == 408, data
        assert READ_TIMEOUT * 0.8 < elapsed < READ_TIMEOUT + 3
        assert b"request_timeout" in data
        assert sock.recv(1) == b""  # and the connection is closed


def test_slow_headers_close_the_connection(server):
    for partial in (b"", b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"):
        with connect(server) as sock:
            sock.sendall(partial)
            start = time.monotonic()
            assert sock.recv(1) == b""  # closed by the server, not by the 10 s socket timeout
            assert time.monotonic() - start < READ_TIMEOUT + 3


def test_concurrent_body_reads_are_bounded(server):
    """Two bodies arriving slowly take both places; a third gets 503 at once; once they time
    out, bodies are read again."""
    key = "aieng_request_rejected_total{reason=too_many_uploads}"
    counted = server.metrics().get(key, 0.0)
    slow = [connect(server) for _ in range(2)]
    try:
        for sock in slow:
            sock.sendall(head("/v1/completions", 1000, AUTH) + b"{")
        time.sleep(0.2)
        with connect(server) as sock:
            sock.sendall(head("/v1/completions", 1000, AUTH))
            status, data = read_response(sock)
            assert status == 503 and b"too_many_uploads" in data, data
            assert sock.recv(1) == b""
        assert server.metrics().get(key, 0.0) == counted + 1  # counted as a refusal
        for sock in slow:
            assert read_response(sock)[0] == 408
    finally:
        for sock in slow:
            sock.close()
    response = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": "hi", "max_tokens": 2},
        headers=AUTH,
        timeout=30,
    )
    assert response.status_code == 200, response.text


def _health_while_posting(server: ThreadServer, body: bytes) -> tuple[httpx.Response, float]:
    """The response to `body` on the chat route and the slowest /health answered meanwhile."""
    result: list[httpx.Response] = []

    def post() -> None:
        result.append(
            httpx.post(
                f"{server.url}/v1/chat/completions",
                content=body,
                headers={**AUTH, "content-type": "application/json"},
                timeout=60,
            )
        )

    worker = threading.Thread(target=post)
    worker.start()
    worst = 0.0
    with httpx.Client(timeout=10) as client:
        while worker.is_alive():
            start = time.monotonic()
            assert client.get(f"{server.url}/health").status_code == 200
            worst = max(worst, time.monotonic() - start)
            time.sleep(0.02)
    worker.join()
    assert result
    return result[0], worst


@pytest.mark.parametrize(
    "messages",
    [
        # more messages than a request may carry: refused by name after a parse off the loop
        [{"role": "user", "content": f"{i % 100}"} for i in range(100_000)],
        # as many as it may carry, 3 MB of text: parsed, validated, rendered off the loop
        [{"role": "user", "content": "And God said " * 60} for _ in range(MAX_MESSAGES)],
    ],
    ids=["too-many-messages", "max-messages"],
)
def test_huge_chat_body_does_not_stall_the_event_loop(server, messages):
    body = json.dumps({"model": "tiny-llama", "messages": messages, "max_tokens": 1}).encode()
    assert len(body) > 3_000_000
    response, worst = _health_while_posting(server, body)
    # neither fits: too many messages, or far more prompt tokens than the context
    assert response.status_code == 400, response.text[:500]
    assert response.json()["error"]["param"] in ("messages", "prompt"), response.text[:500]
    assert worst < 0.5, f"/health took {worst:.2f} s while a huge chat body was handled"


def test_ready_follows_a_dead_engine(model):
    with hardened(model) as s:
        assert httpx.get(f"{s.url}/ready").status_code == 200
        s.in_engine(lambda engine: setattr(engine, "dead_reason", "the device fell over"))
        deadline = time.monotonic() + 10
        while s.ctx.engine.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.ctx.engine_failed
        for path in ("/health", "/ready"):
            response = httpx.get(f"{s.url}{path}")
            assert response.status_code == 503, (path, response.text)
            assert response.json()["status"] == "dead"
            assert "fell over" in response.json()["reason"]
            assert httpx.head(f"{s.url}{path}").status_code == 503


def test_huge_invalid_body_gets_the_usual_400(server):
    """Validated off the loop, a large body's errors are the same OpenAI 400s."""
    last = MAX_MESSAGES - 1
    messages = [{"role": "user", "content": "hi" * 20}] * last + [{"role": "robot", "content": "x"}]
    response = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": "tiny-llama", "messages": messages},
        headers=AUTH,
        timeout=60,
    )
    assert response.status_code == 400, response.text
    assert len(response.request.content) > 64 * 1024  # past the off-loop threshold
    assert response.json()["error"]["param"].startswith(f"messages.{last}"), response.text
    response = httpx.post(
        f"{server.url}/v1/completions",
        content=b'{"prompt": "' + b"a" * 100_000 + b'", ',
        headers={**AUTH, "content-type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"
