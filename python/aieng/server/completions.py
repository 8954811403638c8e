"""`POST /v1/completions`: OpenAI's legacy completions, streaming and not, batched prompts."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from aieng.async_engine import AsyncLLMEngine
from aieng.server.context import ServerContext, context_of
from aieng.server.errors import invalid
from aieng.server.generation import Delta, Generation
from aieng.server.offloop import OffLoopBodyRoute
from aieng.server.openapi_docs import ERROR_RESPONSES
from aieng.server.params import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    check_request,
    mark_ignored_fields,
    note_ignored_fields,
    resolve_max_tokens,
    sampling_params,
)
from aieng.server.protocol import CompletionRequest
from aieng.server.streaming import Shapes, respond
from aieng.server.structured import compile_constraint

router = APIRouter(route_class=OffLoopBodyRoute)


@router.post("/v1/completions", responses=ERROR_RESPONSES)
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    ctx = context_of(request)
    ctx.check_model(body.model)
    engine = ctx.ready_engine(request, body.model)
    check_request(body)
    ignored = note_ignored_fields(body, ctx.warned_fields)
    prompts = await _prompt_ids(ctx, body, engine)
    params = []
    for ids in prompts:
        max_tokens = resolve_max_tokens(
            body.max_tokens, len(ids), engine.max_model_len, COMPLETIONS_DEFAULT_MAX_TOKENS
        )
        params.append(sampling_params(body, max_tokens, body.logprobs, ctx.model_defaults))
    await compile_constraint(engine, params[0], body)
    generation = Generation(ctx, request, engine, prompts, params)
    response = await respond(
        generation,
        body.stream,
        body.include_usage_in_stream,
        _shapes(ctx, generation),
        body.continuous_usage_in_stream,
    )
    return mark_ignored_fields(response, ignored)


async def _prompt_ids(
    ctx: ServerContext, body: CompletionRequest, engine: AsyncLLMEngine
) -> list[list[int]]:
    prompts = body.prompts
    if isinstance(prompts[0], str):
        if any(not p for p in prompts):
            raise invalid("the prompt is empty", "prompt")
        tokenizer = engine.tokenizer
        ids = await asyncio.to_thread(tokenizer.encode_batch, prompts, True)
        if any(not p for p in ids):
            raise invalid("the prompt has no tokens", "prompt")
        return ids
    for p in prompts:
        if not p:
            raise invalid("the prompt is empty", "prompt")
        ctx.check_token_ids(p, "prompt")  # type: ignore[arg-type]
    return [list(p) for p in prompts]  # type: ignore[arg-type]


def _shapes(ctx: ServerContext, generation: Generation) -> Shapes:
    offsets: dict[int, int] = {}  # choice -> text length of its tokens sent so far

    def choice_delta(d: Delta) -> dict[str, Any]:
        logprobs = _logprobs(ctx, generation, d.token_ids, d.logprobs, offsets.get(d.index, 0))
        if logprobs is not None:
            offsets[d.index] = logprobs.pop("_end")
        return {
            "index": d.index,
            "text": d.text,
            "logprobs": logprobs,
            "finish_reason": d.finish_reason,
            "stop_reason": generation.choices[d.index].stop_reason if d.finish_reason else None,
        }

    return Shapes(_head(ctx, generation), choice_delta, lambda: _completion(ctx, generation))


def _head(ctx: ServerContext, generation: Generation) -> dict[str, Any]:
    return {
        "id": f"cmpl-{generation.request_id}",
        "object": "text_completion",
        "created": generation.created,
        "model": ctx.config.served_model_name,
    }


def _completion(ctx: ServerContext, generation: Generation) -> dict[str, Any]:
    choices = [
        {
            "index": i,
            "text": "".join(c.text),
            "logprobs": _whole_logprobs(ctx, generation, c.token_ids, c.logprobs),
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        for i, c in enumerate(generation.choices)
    ]
    return {**_head(ctx, generation), "choices": choices, "usage": generation.usage()}


def _whole_logprobs(
    ctx: ServerContext,
    generation: Generation,
    token_ids: list[int],
    logprobs: list[dict[int, float]] | None,
) -> dict[str, Any] | None:
    out = _logprobs(ctx, generation, token_ids, logprobs, 0)
    if out is not None:
        del out["_end"]
    return out


def _logprobs(
    ctx: ServerContext,
    generation: Generation,
    token_ids: list[int],
    logprobs: list[dict[int, float]] | None,
    start: int,
) -> dict[str, Any] | None:
    """OpenAI's legacy logprobs of some tokens, whose text begins at character `start` of the
    choice's text; `_end` (for the caller to remove) is where the next token's text begins."""
    if logprobs is None:
        return None
    k = generation.params[0].logprobs or 0
    tokens = [ctx.token_text(t) for t in token_ids]
    offsets, offset = [], start
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [lp[t] for t, lp in zip(token_ids, logprobs, strict=True)],
        "top_logprobs": [_top(ctx, lp, k) for lp in logprobs],
        "text_offset": offsets,
        "_end": offset,
    }


def _top(ctx: ServerContext, logprobs: dict[int, float], k: int) -> dict[str, float]:
    """The k most likely tokens by text; of two tokens with one text the likelier is kept."""
    top: dict[str, float] = {}
    for token, value in sorted(logprobs.items(), key=lambda kv: -kv[1])[:k]:
        top.setdefault(ctx.token_text(token), value)
    return top
