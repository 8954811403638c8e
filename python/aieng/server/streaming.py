"""From a started `Generation` to the HTTP response: one JSON body, or server-sent events
(`data: {json}\\n\\n` chunks ending with `data: [DONE]\\n\\n`).

The status line waits for the first output, so a request that ends with nothing (a timeout in
the queue, a drain) still gets an error status. However a response ends (finished, client
gone, cancelled), the generation is closed: what still runs is aborted and its blocks freed.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse, Response
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from aieng.server.errors import ApiError, error_body
from aieng.server.generation import ClientGone, Delta, Generation
from aieng.server.stages import mark

DONE = b"data: [DONE]\n\n"
CLIENT_CLOSED = 499  # nginx's code: nobody reads it, the logs and metrics do


@dataclass
class Shapes:
    """An endpoint's JSON: the fields every chunk shares, a choice's delta (None: nothing to
    send yet, as while a tool call is being written), the whole body."""

    head: dict[str, Any]
    choice_delta: Callable[[Delta], dict[str, Any] | None]
    whole: Callable[[], dict[str, Any]]


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


async def respond(
    generation: Generation,
    stream: bool,
    include_usage: bool,
    shapes: Shapes,
    continuous_usage: bool = False,
) -> Response:
    """With `continuous_usage` (vLLM's `stream_options.continuous_usage_stats`) every chunk
    carries the usage so far; with `include_usage` a last chunk carries the final usage."""
    generation.start()
    try:
        if not stream:
            await generation.collect()
            generation.close()
            return JSONResponse(shapes.whole())
        first = await generation.first_deltas()
    except ClientGone:
        generation.close()
        return Response(status_code=CLIENT_CLOSED)
    except ApiError as error:
        generation.fail(error)
        generation.close()
        raise
    except BaseException:
        generation.close()
        raise
    events = _events(generation, first, include_usage, shapes, continuous_usage)
    return GenerationStream(generation, events)


class GenerationStream(StreamingResponse):
    def __init__(self, generation: Generation, body: AsyncIterator[bytes]):
        headers = {"Cache-Control": "no-cache"}
        super().__init__(body, media_type="text/event-stream", headers=headers)
        self.generation = generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.close()


async def _events(
    generation: Generation,
    first: list[Delta],
    include_usage: bool,
    shapes: Shapes,
    continuous_usage: bool,
) -> AsyncIterator[bytes]:
    usage_field = {"usage": None} if include_usage else {}

    def chunk(deltas: list[Delta]) -> bytes:
        # A token whose text is held back (a partial character, a possible stop string) goes
        # out with the text that completes it, unless its logprobs were asked for.
        shown = [d for d in deltas if d.text or d.finish_reason or d.logprobs]
        if not shown:
            return b""
        choices = [c for c in map(shapes.choice_delta, shown) if c is not None]
        if not choices:
            return b""
        usage = {"usage": generation.usage()} if continuous_usage else usage_field
        return sse({**shapes.head, "choices": choices, **usage})

    yield chunk(first)
    mark(generation.http.scope, "sent")  # resumed once the first chunk was handed to the socket
    try:
        async for deltas in generation.remaining_deltas():
            yield chunk(deltas)
    except ApiError as error:  # the status line is sent: report it in the stream
        generation.fail(error)
        yield sse(error_body(error.status, error.message, error.param, error.code))
        yield DONE
        return
    if include_usage:
        yield sse({**shapes.head, "choices": [], "usage": generation.usage()})
    yield DONE
