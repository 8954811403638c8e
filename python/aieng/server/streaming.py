"""Server-sent events: `data: {json}\\n\\n` chunks ending with `data: [DONE]\\n\\n`.

The response owns its `Generation`: however the stream ends (finished, client gone,
cancelled), `close()` runs, which aborts what still runs and frees its KV blocks.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from aieng.server.errors import ApiError, error_body
from aieng.server.generation import Delta, Generation

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class GenerationStream(StreamingResponse):
    def __init__(self, generation: Generation, body: AsyncIterator[bytes]):
        super().__init__(
            body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self.generation = generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.close()


def stream_response(
    generation: Generation,
    first: list[Delta],
    chunk: Callable[[list[Delta]], list[dict]],
    usage_chunk: Callable[[], dict] | None,
) -> GenerationStream:
    """Streams `first` and then the rest; `chunk` turns deltas into chunk payloads."""

    def chunks(deltas: list[Delta]) -> list[dict]:
        # A token whose text is held back (a partial character, a possible stop string) is
        # sent with the text that completes it, unless its logprobs were asked for.
        shown = [d for d in deltas if d.text or d.finish_reason or d.logprobs]
        return chunk(shown) if shown else []

    async def body() -> AsyncIterator[bytes]:
        for payload in chunks(first):
            yield sse(payload)
        try:
            async for deltas in generation.remaining_deltas():
                for payload in chunks(deltas):
                    yield sse(payload)
        except ApiError as error:  # the status line is sent: report it in the stream
            generation.fail(error)
            yield sse(error_body(error.status, error.message, error.param, error.code))
            yield DONE
            return
        if usage_chunk is not None:
            yield sse(usage_chunk())
        yield DONE

    return GenerationStream(generation, body())
