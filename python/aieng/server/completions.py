"""`POST /v1/completions`: OpenAI's legacy completions, streaming and not, batched prompts.

`echo` returns each prompt before its completion; with `logprobs` the prompt's tokens come first
in `logprobs` too, each scored in the prefill's own forward (SamplingParams.prompt_logprobs; the
first token has no context, so its logprob is null). With `max_tokens` 0 only the prompt is
scored: lm-evaluation-harness's loglikelihood requests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from aieng.engine.engine_client import EngineClient
from aieng.server.clients import client_of
from aieng.server.context import ServerContext, context_of
from aieng.server.errors import invalid
from aieng.server.generation import Delta, Generation
from aieng.server.logprob_json import json_logprob
from aieng.server.offloop import OffLoopBodyRoute
from aieng.server.openapi_docs import ERROR_RESPONSES, STREAM_RESPONSES
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


@router.post("/v1/completions", responses={**STREAM_RESPONSES, **ERROR_RESPONSES})
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    ctx = context_of(request)
    ctx.check_model(body.model)
    engine = ctx.ready_engine(request, body.model)
    check_request(body)
    ignored = note_ignored_fields(body, ctx.warned_fields)
    prompts = await _prompt_ids(ctx, request, body, engine)
    params = []
    score_prompt = body.logprobs if body.echo else None
    for ids in prompts:
        max_tokens = resolve_max_tokens(
            body.max_tokens,
            len(ids),
            engine.model_info.max_model_len,
            COMPLETIONS_DEFAULT_MAX_TOKENS,
        )
        sampling = sampling_params(body, max_tokens, body.logprobs, ctx.model_defaults)
        params.append(dataclasses.replace(sampling, prompt_logprobs=score_prompt))
    await compile_constraint(engine, params[0], body)
    generation = Generation(ctx, request, engine, prompts, params)
    echo = None
    if body.echo:
        texts = body.prompts if isinstance(body.prompts[0], str) else None
        echo = _Echo(ctx, generation, texts)  # type: ignore[arg-type]
    response = await respond(
        generation,
        body.stream,
        body.include_usage_in_stream,
        _shapes(ctx, generation, echo),
        body.continuous_usage_in_stream,
    )
    return mark_ignored_fields(response, ignored)


async def _prompt_ids(
    ctx: ServerContext, request: Request, body: CompletionRequest, engine: EngineClient
) -> list[list[int]]:
    prompts = body.prompts
    if isinstance(prompts[0], str):
        if any(not p for p in prompts):
            raise invalid("the prompt is empty", "prompt")
        most = engine.model_info.max_model_len - 1  # a prompt leaves room for one output token
        texts: list[str] = prompts  # type: ignore[assignment]
        ids = await ctx.tokenizing.encode(
            client_of(request), engine.tokenizer, texts, True, "prompt", most
        )
        if any(not p for p in ids):
            raise invalid("the prompt has no tokens", "prompt")
        return ids
    for p in prompts:
        if not p:
            raise invalid("the prompt is empty", "prompt")
        ctx.check_token_ids(p, "prompt")  # type: ignore[arg-type]
    return [list(p) for p in prompts]  # type: ignore[arg-type]


class _Echo:
    """Each choice's prompt, as text and (with logprobs) as OpenAI's legacy logprobs."""

    def __init__(self, ctx: ServerContext, generation: Generation, texts: list[str] | None):
        self.ctx, self.generation = ctx, generation
        tokenizer = generation.engine.tokenizer
        self.texts = texts or [
            tokenizer.decode(p, skip_special_tokens=False) for p in generation.prompts
        ]

    def head(self, choice: int) -> tuple[str, dict[str, Any] | None]:
        """The prompt's text and, once scored, its tokens, logprobs (the first null, it has no
        context), top alternatives and offsets from 0 (`_end`: where its text ends)."""
        index = choice // self.generation.n
        scored = self.generation.prompt_logprobs[index]
        if scored is None:
            return self.texts[index], None
        prompt = self.generation.prompts[index]
        k = self.generation.params[index].logprobs or 0
        return self.texts[index], _logprobs_of(self.ctx, prompt, scored, k, 0)


def _choice_part(
    ctx: ServerContext,
    generation: Generation,
    echo: _Echo | None,
    choice: int,
    text: str,
    token_ids: list[int],
    logprobs: list[dict[int, float]] | None,
    start: int,
) -> tuple[str, dict[str, Any] | None, int]:
    """A choice's text and legacy logprobs, whose text begins at character `start`; with
    `echo` (the choice's first part) the prompt comes first. -> (text, logprobs, end)."""
    head_text, head = echo.head(choice) if echo is not None else ("", None)
    if head is not None:
        start = head.pop("_end")
    tail = _logprobs(ctx, generation, token_ids, logprobs, start)
    end = tail.pop("_end") if tail is not None else start
    if head is not None:
        tail = {key: head[key] + (tail[key] if tail else []) for key in head}
    return head_text + text, tail, end


def _shapes(ctx: ServerContext, generation: Generation, echo: _Echo | None) -> Shapes:
    offsets: dict[int, int] = {}  # choice -> text length of its tokens sent so far

    def choice_delta(d: Delta) -> dict[str, Any]:
        first = d.index not in offsets
        text, logprobs, offsets[d.index] = _choice_part(
            ctx,
            generation,
            echo if first else None,
            d.index,
            d.text,
            d.token_ids,
            d.logprobs,
            offsets.get(d.index, 0),
        )
        return {
            "index": d.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": d.finish_reason,
            "stop_reason": generation.choices[d.index].stop_reason if d.finish_reason else None,
        }

    return Shapes(_head(ctx, generation), choice_delta, lambda: _completion(ctx, generation, echo))


def _head(ctx: ServerContext, generation: Generation) -> dict[str, Any]:
    return {
        "id": f"cmpl-{generation.request_id}",
        "object": "text_completion",
        "created": generation.created,
        "model": ctx.config.served_model_name,
    }


def _completion(ctx: ServerContext, generation: Generation, echo: _Echo | None) -> dict[str, Any]:
    choices = []
    for i, c in enumerate(generation.choices):
        text, logprobs, _ = _choice_part(
            ctx, generation, echo, i, "".join(c.text), c.token_ids, c.logprobs, 0
        )
        choices.append(
            {
                "index": i,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
        )
    return {**_head(ctx, generation), "choices": choices, "usage": generation.usage()}


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
    return _logprobs_of(ctx, token_ids, logprobs, generation.params[0].logprobs or 0, start)


def _logprobs_of(
    ctx: ServerContext,
    token_ids: list[int],
    logprobs: Sequence[dict[int, float] | None],
    k: int,
    start: int,
) -> dict[str, Any]:
    tokens = [ctx.token_text(t) for t in token_ids]
    offsets, offset = [], start
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [
            None if lp is None else json_logprob(lp[t])
            for t, lp in zip(token_ids, logprobs, strict=True)
        ],
        "top_logprobs": [None if lp is None else _top(ctx, lp, k) for lp in logprobs],
        "text_offset": offsets,
        "_end": offset,
    }


def _top(ctx: ServerContext, logprobs: dict[int, float], k: int) -> dict[str, float]:
    """The k most likely tokens by text; of two tokens with one text the likelier is kept."""
    top: dict[str, float] = {}
    for token, value in sorted(logprobs.items(), key=lambda kv: -kv[1])[:k]:
        top.setdefault(ctx.token_text(token), json_logprob(value))
    return top
