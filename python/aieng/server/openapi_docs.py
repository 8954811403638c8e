"""Response shapes for the OpenAPI document (routes build their JSON directly, for speed)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


SSE_EVENT = {
    "type": "object",
    "properties": {
        "data": {
            "type": "string",
            "description": "A chunk as JSON (or an error body), then `[DONE]` to end the stream.",
        },
        "event": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
    "required": ["data"],
}

STREAM_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The completion as one JSON body, or with `stream` as server-sent events "
        "(`data: {json}` chunks ending with `data: [DONE]`).",
        # the schema of each event (OpenAPI 3.2's reading of a sequential media type)
        "content": {"text/event-stream": {"schema": SSE_EVENT}},
    }
}

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: _error("The request is invalid; the message names the problem and `param` the field."),
    401: _error("The API key is missing or wrong."),
    404: _error("The request names a model this server does not serve."),
    413: _error("The body is larger than the server's limit."),
    429: _error("The waiting queue or the KV cache is full; retry after `Retry-After` seconds."),
    503: _error("The server is starting or shutting down, or the request timed out waiting."),
}
