"""ASGI middleware in front of every route: request ids, the API key (checked before any body
is read), the body size limit, its read timeouts and the bounds on bodies read at once."""

from __future__ import annotations

import hmac
import re
import time
import uuid
from collections import Counter
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from aieng.engine.within import within
from aieng.server.errors import error_bytes
from aieng.server.small_first import SMALL_BODY_BYTES, SmallFirst
from aieng.server.stages import mark

REQUEST_ID_HEADER = b"x-request-id"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return None


def _peer(scope: Scope) -> str:
    """The client's address (behind a proxy: the proxy's)."""
    client = scope.get("client")
    return client[0] if client else ""


def _has_body(scope: Scope) -> bool:
    declared = _header(scope, b"content-length")
    return (declared is not None and declared != b"0") or (
        _header(scope, b"transfer-encoding") is not None
    )


# On an answer given before the body was read: the connection closes rather than wait for
# (and discard) the rest of a body nobody will read.
CLOSE = (b"connection", b"close")


async def _send_error(
    send: Send, status: int, message: str, code: str, headers: list[tuple[bytes, bytes]] = ()
) -> None:
    body = error_bytes(status, message, None, code)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class RequestIdMiddleware:
    """Honours a well-formed incoming X-Request-Id, else makes one; returns it on the response.
    Notes the arrival time, from which TTFT and the request timeout count."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = (_header(scope, REQUEST_ID_HEADER) or b"").decode("latin-1")
        request_id = incoming if _REQUEST_ID.fullmatch(incoming) else uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"], state["arrival"] = request_id, time.monotonic()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0] != REQUEST_ID_HEADER]
                message["headers"] = [*headers, (REQUEST_ID_HEADER, request_id.encode())]
            await send(message)

        await self.app(scope, receive, send_with_id)


class BodyLimitMiddleware:
    """Reads the whole body first: past `max_bytes` the answer is 413 before any route runs.

    A body must arrive in full within `body_timeout` seconds, and with no pause of
    `read_timeout` seconds; past either the answer is 408 and the connection closes (a slow or
    trickling client cannot pin a connection and its buffered body). At most
    `max_concurrent_reads` bodies are read at once (past it 503 at once, so buffered bodies
    never hold more than `max_concurrent_reads * max_bytes` of memory), and at most
    `max_reads_per_client` of them from one peer address (past it 429), so one client cannot
    hold every place. Runs inside the API key check, so an unauthenticated request is refused
    before its body is read. Each 503/429 it answers is reported to `on_refused` by reason, so
    the server's refusal counter holds every refusal a client sees. With `small_first`, a large
    body waits before each chunk while small requests are on their way to their first answer
    (see `small_first`).
    """

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        read_timeout: float | None = None,
        max_concurrent_reads: int | None = None,
        body_timeout: float | None = None,
        max_reads_per_client: int | None = None,
        on_refused: Callable[[str], None] | None = None,
        small_first: SmallFirst | None = None,
    ):
        self.app, self.max_bytes = app, max_bytes
        self.small_first = small_first
        self.on_refused = on_refused
        self.read_timeout, self.body_timeout = read_timeout, body_timeout
        self.max_concurrent_reads = max_concurrent_reads
        self.max_reads_per_client = max_reads_per_client
        # bodies being read now, in all and by peer address (one event loop: no lock needed)
        self.reading = 0
        self.reading_by_client: Counter[str] = Counter()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None:
            if not declared.isdigit():
                await _send_error(send, 400, "Content-Length is not a number", "invalid_header")
                return
            if int(declared) > self.max_bytes:
                await self._too_large(send)
                return
        large = _has_body(scope) and (declared is None or int(declared) > SMALL_BODY_BYTES)
        if self.small_first is not None and not large:
            await self._small(scope, receive, send, self.small_first.hold())
            return
        await self._with_body(scope, receive, send, large)

    async def _small(
        self, scope: Scope, receive: Receive, send: Send, release: Callable[[], None]
    ) -> None:
        """A small request: large bodies wait until its first answer is sent."""

        async def send_then_release(message: Message) -> None:
            await send(message)
            if message["type"] == "http.response.body":
                release()

        try:
            await self._with_body(scope, receive, send_then_release, large=False)
        finally:
            release()

    async def _with_body(self, scope: Scope, receive: Receive, send: Send, large: bool) -> None:
        if not _has_body(scope):
            await self.app(scope, receive, send)
            return
        client = _peer(scope)
        if await self._refused(client, send):
            return
        self.reading += 1
        self.reading_by_client[client] += 1
        try:
            body = await self._read(receive, send, large)
        finally:
            self.reading -= 1
            self.reading_by_client[client] -= 1
            if not self.reading_by_client[client]:
                del self.reading_by_client[client]
        if body is None:
            return
        mark(scope, "body_read")
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            try:
                return await receive()
            except Exception:
                # After the body only a disconnect can arrive; a transport that fails instead
                # (Ray Serve raises its cancelled task's error here when the client goes) means
                # the same: the client is gone, and a stream ends without a traceback.
                return {"type": "http.disconnect"}

        await self.app(scope, replay, send)

    async def _refused(self, client: str, send: Send) -> bool:
        """Answers 503 when every place to read a body is taken, 429 when this client holds its
        share of them."""
        if self.max_concurrent_reads is not None and self.reading >= self.max_concurrent_reads:
            self._count_refusal("too_many_uploads")
            await _send_error(
                send,
                503,
                "too many request bodies are being received; retry later",
                "too_many_uploads",
                [(b"retry-after", b"1"), CLOSE],
            )
            return True
        held = self.reading_by_client[client]
        if self.max_reads_per_client is not None and held >= self.max_reads_per_client:
            self._count_refusal("too_many_uploads_from_client")
            await _send_error(
                send,
                429,
                f"this client is already sending {held} request bodies, the most one client "
                "may send at once; retry when one of them is in",
                "too_many_uploads_from_client",
                [(b"retry-after", b"1"), CLOSE],
            )
            return True
        return False

    def _count_refusal(self, reason: str) -> None:
        if self.on_refused is not None:
            self.on_refused(reason)

    async def _read(self, receive: Receive, send: Send, large: bool) -> bytes | None:
        """The body, or None once an error was answered or the client left. A large body's
        chunks wait for small requests (`small_first`)."""
        chunks: list[bytes] = []
        size = 0
        deadline = None if self.body_timeout is None else time.monotonic() + self.body_timeout
        while True:
            if large and self.small_first is not None:
                await self.small_first.turn()
            wait, whole = self.read_timeout, False
            if deadline is not None:
                left = max(0.0, deadline - time.monotonic())
                if wait is None or left < wait:
                    wait, whole = left, True
            try:
                message = await within(receive(), wait)
            except TimeoutError:
                await self._timed_out(send, whole)
                return None
            if message["type"] != "http.request":  # the client left before sending it all
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(send)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _timed_out(self, send: Send, whole: bool) -> None:
        if whole:
            message = f"the request body did not arrive in full within {self.body_timeout:g} s"
        else:
            message = f"no part of the request body arrived for {self.read_timeout:g} s"
        await _send_error(send, 408, message, "request_timeout", [CLOSE])

    async def _too_large(self, send: Send) -> None:
        await _send_error(
            send,
            413,
            f"the request body is larger than the limit of {self.max_bytes} bytes",
            "body_too_large",
            [CLOSE],
        )


class ApiKeyMiddleware:
    """`Authorization: Bearer <key>` on the API routes, compared in constant time."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = b"Bearer " + api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        protected = scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIXES)
        if protected and scope.get("method") != "OPTIONS":
            given = _header(scope, b"authorization") or b""
            if not hmac.compare_digest(given, self.expected):
                await _send_error(
                    send,
                    401,
                    "a valid API key is required: send 'Authorization: Bearer <key>'",
                    "invalid_api_key",
                    [(b"www-authenticate", b"Bearer"), *([CLOSE] if _has_body(scope) else [])],
                )
                return
        await self.app(scope, receive, send)
