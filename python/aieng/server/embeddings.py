"""`POST /v1/embeddings`: OpenAI's embeddings over the engine's prefill-only requests.

Each input is one engine request (`PoolingParams`), admitted, timed out, aborted on disconnect
and accounted like a completion's prompt (`Generation`). The pooling is the request's `pooling`,
else the checkpoint's (sentence-transformers files), else the server's `--pooling`; with none
of them the request is refused with a 400 naming `pooling`. `dimensions` keeps the first
components and renormalises (Matryoshka); `encoding_format` "base64" sends each vector as the
base64 of its little-endian float32 bytes, as OpenAI does.
"""

from __future__ import annotations

import base64

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from aieng.engine.engine_client import EngineClient
from aieng.errors import InvalidArgumentError
from aieng.pooling import check_dimensions, resolve_pooling, truncate_dimensions
from aieng.server.clients import client_of
from aieng.server.context import ServerContext, context_of
from aieng.server.embedding_protocol import EmbeddingRequest
from aieng.server.errors import ApiError, invalid
from aieng.server.generation import ClientGone, Generation
from aieng.server.offloop import OffLoopBodyRoute
from aieng.server.openapi_docs import ERROR_RESPONSES
from aieng.server.streaming import CLIENT_CLOSED

router = APIRouter(route_class=OffLoopBodyRoute)


@router.post("/v1/embeddings", responses=ERROR_RESPONSES)
async def create_embeddings(body: EmbeddingRequest, request: Request) -> Response:
    ctx = context_of(request)
    ctx.check_model(body.model)
    engine = ctx.ready_engine(request, body.model)
    info = engine.model_info
    try:
        pooling = resolve_pooling(body.pooling, info.pooling)
    except InvalidArgumentError as error:
        raise invalid(str(error), "pooling") from None
    try:
        check_dimensions(body.dimensions, info.hidden_size)
    except InvalidArgumentError as error:
        raise invalid(str(error), "dimensions") from None
    prompts = await _input_ids(ctx, request, body, engine)
    generation = Generation(
        ctx, request, engine, prompts, [pooling] * len(prompts), field_names={"prompt": "input"}
    )
    generation.start()
    try:
        await generation.collect()
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    except ApiError as error:
        generation.fail(error)
        raise
    finally:
        generation.close()
    data = []
    for index, vector in enumerate(generation.embeddings):
        if vector is None:  # it ended without its prompt pooled
            raise ApiError(500, f"request {generation.request_id}: input {index} was not embedded")
        data.append(
            {
                "object": "embedding",
                "index": index,
                "embedding": _encoded(truncate_dimensions(vector, body.dimensions), body),
            }
        )
    tokens = generation.prompt_tokens
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "model": ctx.config.served_model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )


async def _input_ids(
    ctx: ServerContext, request: Request, body: EmbeddingRequest, engine: EngineClient
) -> list[list[int]]:
    inputs = body.inputs
    context = engine.model_info.max_model_len
    if isinstance(inputs[0], str):
        texts: list[str] = inputs  # type: ignore[assignment]
        tokenizer = engine.tokenizer
        ids = await ctx.tokenizing.encode(
            client_of(request), tokenizer, texts, True, "input", context - 1
        )
    else:
        for p in inputs:
            ctx.check_token_ids(p, "input")  # type: ignore[arg-type]
        ids = [list(p) for p in inputs]  # type: ignore[arg-type]
    for index, p in enumerate(ids):
        if not p:
            raise invalid(f"input {index} has no tokens", "input")
        if len(p) >= context:
            raise invalid(
                f"input {index} has {len(p)} tokens; the model embeds at most {context - 1}",
                "input",
                "context_length_exceeded",
            )
    return ids


def _encoded(vector: np.ndarray, body: EmbeddingRequest) -> list[float] | str:
    values = np.asarray(vector, dtype="<f4")
    if body.encoding_format == "base64":
        return base64.b64encode(values.tobytes()).decode("ascii")
    return values.tolist()
