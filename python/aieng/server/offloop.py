"""Large request bodies are parsed and validated in a worker thread.

FastAPI parses and validates a body on the event loop; for a 3.4 MB chat body of 100k
messages that is a third of a second in which nothing else (not even /health) is answered.
Routes of an `APIRouter(route_class=OffLoopBodyRoute)` parse and validate bodies past
`OFF_LOOP_BYTES` in the server's parsing pool and hand FastAPI the validated model, which it
takes as it is. The pool has one thread, served in fair shares of bytes between clients: JSON
parsing holds the GIL throughout, so several parses at once would starve the engine's thread
(which gives the GIL up at every kernel) — a flood of large bodies queues behind itself.
Before parsing, a body of a route in `oversize.TEXT_FIELDS` is scanned with the GIL released
and refused unparsed if its text can never fit the model (see `oversize`). Like each chunk of
a large body, its scan and parse first wait while small requests await their first answer
(`small_first`): a core and the GIL go to them, not to a flood's bodies already read.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from aieng.server import oversize
from aieng.server.clients import client_of
from aieng.server.stages import mark

OFF_LOOP_BYTES = 64 * 1024


class OffLoopBodyRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        field = self.body_field
        model = None if field is None else field.field_info.annotation
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return handler

        async def handle(request: Request) -> Response:
            body = await whole_body(request)
            if len(body) > OFF_LOOP_BYTES:
                ctx = request.app.state.context
                if ctx.small_first is not None:
                    await ctx.small_first.turn()
                bound = await oversize.text_bound(ctx, self.path)
                parsed = await ctx.parsing.run(
                    client_of(request), len(body), _parse, model, body, bound
                )
                if isinstance(parsed, oversize.Oversize):
                    assert bound is not None
                    oversize.refuse(ctx, bound, parsed)
                if parsed is not None:
                    request._json = parsed  # what FastAPI's request.json() returns
                mark(request.scope, "parsed")
            return await handler(request)

        return handle


async def whole_body(request: Request) -> bytes:
    """`request.body()`, without its copy of a body that came in one message (as
    BodyLimitMiddleware hands it on): Starlette joins it with a closing empty chunk, a copy
    made on the event loop with the GIL held (0.6 ms for 4 MB, each time)."""
    if not hasattr(request, "_body"):
        chunks: list[bytes] = []
        more = True
        while more:
            message = await request.receive()
            if message["type"] != "http.request":
                raise ClientDisconnect()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        one = len(chunks) == 1 and type(chunks[0]) is bytes
        request._body = chunks[0] if one else b"".join(chunks)
    return request._body


def _parse(
    model: type[BaseModel], body: bytes, bound: oversize.TextBound | None
) -> BaseModel | oversize.Oversize | None:
    """The validated model; None when the body is not JSON (FastAPI then answers as usual);
    the text past `bound`, unparsed, when there is one."""
    found = None if bound is None else oversize.scan(bound, body)
    if found is not None:
        return found
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):  # too deep: not JSON here
        return None
    try:
        return model.model_validate(data)
    except ValidationError as error:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in error.errors(include_url=False)]
        raise RequestValidationError(errors, body=data) from None
