"""ASGI middleware in front of every route: request ids, the body size limit, the API key."""

from __future__ import annotations

import hmac
import re
import time
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from aieng.server.errors import error_bytes

REQUEST_ID_HEADER = b"x-request-id"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return None


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
    """Reads the whole body first: past `max_bytes` the answer is 413 before any route runs."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

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
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send: Send) -> None:
        await _send_error(
            send,
            413,
            f"the request body is larger than the limit of {self.max_bytes} bytes",
            "body_too_large",
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
                    [(b"www-authenticate", b"Bearer")],
                )
                return
        await self.app(scope, receive, send)
