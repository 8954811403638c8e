"""Counts every HTTP answer the server gives — `aieng_http_requests_total{route, status}` —
so that an error rate is one PromQL ratio: answers given by the middleware (401, 413, 503 for
too many bodies) count as much as the routes' own.

Routes are labelled by the API path they match and everything else as "other", so a client
probing random paths cannot grow the series without bound."""

from __future__ import annotations

from prometheus_client import Counter
from starlette.types import ASGIApp, Message, Receive, Scope, Send

ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/embeddings",
    "/v1/models",
    "/tokenize",
    "/detokenize",
    "/health",
    "/ready",
    "/metrics",
    "/version",
)


def route_label(path: str) -> str:
    for route in ROUTES:
        if path == route or path.startswith(route + "/"):
            return route
    return "other"


class HttpMetricsMiddleware:
    """Outermost but for the request id: sees the status of every answer, or 'disconnected'
    when the client went away before any was started."""

    def __init__(self, app: ASGIApp, counter: Counter, model_name: str):
        self.app, self.counter, self.model_name = app, counter, model_name

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: list[int] = []

        async def send_counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(int(message["status"]))
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            label = str(status[0]) if status else "disconnected"
            self.counter.labels(self.model_name, route_label(scope["path"]), label).inc()
