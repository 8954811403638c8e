"""`POST /v1/chat/completions`: the conversation goes through the model's chat template."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from aieng.engine.engine_client import EngineClient
from aieng.errors import ChatTemplateError, InvalidArgumentError
from aieng.server.clients import client_of
from aieng.server.context import ServerContext, context_of
from aieng.server.errors import invalid
from aieng.server.generation import Delta, Generation
from aieng.server.logprob_json import json_logprob
from aieng.server.offloop import OffLoopBodyRoute
from aieng.server.openapi_docs import ERROR_RESPONSES, STREAM_RESPONSES
from aieng.server.params import (
    check_request,
    mark_ignored_fields,
    note_ignored_fields,
    resolve_max_tokens,
    sampling_params,
)
from aieng.server.protocol import (
    MAX_SCHEMA_NESTING,
    ChatCompletionRequest,
    ChatMessage,
    nesting_depth,
)
from aieng.server.streaming import Shapes, respond
from aieng.server.structured import compile_constraint
from aieng.server.tokenizing import INLINE_COST, too_long, utf8_size
from aieng.server.tool_call_output import ToolCallDeltas, assistant_message
from aieng.server.tool_calls import constrain_to_calls, plan_tools
from aieng.server.tool_parsers import ToolParser

router = APIRouter(route_class=OffLoopBodyRoute)


@router.post("/v1/chat/completions", responses={**STREAM_RESPONSES, **ERROR_RESPONSES})
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    ctx = context_of(request)
    ctx.check_model(body.model)
    engine = ctx.ready_engine(request, body.model)
    check_request(body)
    ignored = note_ignored_fields(body, ctx.warned_fields)
    parser = ctx.config.tool_call_parser
    if body.tools:  # many or large schemas are read into a grammar off the event loop
        plan = await asyncio.to_thread(plan_tools, body, parser)
    else:
        plan = plan_tools(body, parser)
    ids = await render_chat(
        ctx,
        client_of(request),
        body.messages,
        add_generation_prompt=True,
        engine=engine,
        tools=plan.tools,
    )
    param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    max_tokens = resolve_max_tokens(
        body.max_new_tokens,
        len(ids),
        engine.model_info.max_model_len,
        ctx.model_defaults.get("max_tokens"),
        param,
    )
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(body, max_tokens, logprobs, ctx.model_defaults)
    await compile_constraint(engine, params, body)
    params = await constrain_to_calls(engine, params, plan)
    generation = Generation(
        ctx,
        request,
        engine,
        [ids],
        [params],
        field_names={"logprobs": "top_logprobs", "prompt": "messages"},
    )
    response = await respond(
        generation,
        body.stream,
        body.include_usage_in_stream,
        _shapes(ctx, generation, plan.parser),
        body.continuous_usage_in_stream,
    )
    return mark_ignored_fields(response, ignored)


async def render_chat(
    ctx: ServerContext,
    client: tuple[str, str],
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    engine: EngineClient | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The conversation through the chat template of `engine` (the one the request will run
    on: versions may differ in template) or of the default engine; `tools` go to the template
    as transformers' `apply_chat_template(tools=...)` passes them. A rendered text too long to
    fit the context is refused by its length, untokenized."""
    engine = engine or ctx.engine
    assert engine is not None
    tokenizer = engine.tokenizer
    extra = {} if tools is None else {"tools": tools}
    most = engine.model_info.max_model_len - 1  # a prompt leaves room for one output token
    limit = most * await ctx.tokenizing.bytes_per_token(tokenizer)

    def render() -> list[int]:
        conversation = [template_message(m) for m in messages]
        text = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, **extra
        )
        size = utf8_size(text)
        if size > limit:
            raise too_long("messages", None, size, limit, most)
        return tokenizer.encode(text, False)

    cost = sum(utf8_size(m.text) for m in messages)
    if tools is not None:  # the tools' rendering is not counted: never on the event loop
        cost = max(cost, INLINE_COST + 1)
    try:  # in the tokenizer pool: a long conversation stalls neither the loop nor other clients
        ids = await ctx.tokenizing.run(client, cost, render)
    except ChatTemplateError as error:
        raise invalid(f"the chat template failed: {error}", "messages") from error
    except InvalidArgumentError as error:  # a value the template cannot read
        raise invalid(f"the chat template cannot read the request: {error}", "messages") from error
    if not ids:
        raise invalid("the conversation renders to an empty prompt", "messages")
    return ids


def template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it (transformers' convention): the text as content
    (none for an assistant message that only calls tools), a call's arguments as an object
    when they are one (templates write them with `tojson`)."""
    out: dict[str, Any] = {"role": message.role}
    if message.content is not None or not message.tool_calls:
        out["content"] = message.text
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": call.type,
                "function": {
                    "name": call.function.name,
                    "arguments": _arguments_value(call.function.arguments),
                },
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _arguments_value(arguments: str) -> object:
    """The arguments object, or the text as given when it is no object (or nests too deep for
    the template to read)."""
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments
    if not isinstance(value, dict) or nesting_depth(value) > MAX_SCHEMA_NESTING:
        return arguments
    return value


def _shapes(ctx: ServerContext, generation: Generation, parser: ToolParser | None) -> Shapes:
    started: set[int] = set()  # choices whose first delta (with the role) went out
    calls = ToolCallDeltas(parser)

    def choice_delta(d: Delta) -> dict[str, Any] | None:
        delta, finish_reason = calls.delta(d)
        logprobs = _logprobs(ctx, generation, d.token_ids, d.logprobs)
        if not delta and finish_reason is None and logprobs is None:
            return None  # held back: it may be part of a tool call
        if d.index not in started:
            started.add(d.index)
            delta = {"role": "assistant", **delta}
        return {
            "index": d.index,
            "delta": delta or {"content": ""},
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }

    head = _head(ctx, generation, "chat.completion.chunk")
    return Shapes(head, choice_delta, lambda: _chat_completion(ctx, generation, parser))


def _head(ctx: ServerContext, generation: Generation, kind: str) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{generation.request_id}",
        "object": kind,
        "created": generation.created,
        "model": ctx.config.served_model_name,
    }


def _chat_completion(
    ctx: ServerContext, generation: Generation, parser: ToolParser | None
) -> dict[str, Any]:
    choices = []
    for i, c in enumerate(generation.choices):
        message, finish_reason = assistant_message("".join(c.text), c.finish_reason, parser)
        choices.append(
            {
                "index": i,
                "message": message,
                "logprobs": _logprobs(ctx, generation, c.token_ids, c.logprobs),
                "finish_reason": finish_reason,
                "stop_reason": c.stop_reason,
            }
        )
    head = _head(ctx, generation, "chat.completion")
    return {**head, "choices": choices, "usage": generation.usage()}


def _logprobs(
    ctx: ServerContext,
    generation: Generation,
    token_ids: list[int],
    logprobs: list[dict[int, float]] | None,
) -> dict[str, Any] | None:
    if logprobs is None:
        return None
    k = generation.params[0].logprobs or 0
    return {
        "content": [
            {
                **_entry(ctx, token, lp[token]),
                "top_logprobs": [
                    _entry(ctx, t, v) for t, v in sorted(lp.items(), key=lambda kv: -kv[1])[:k]
                ],
            }
            for token, lp in zip(token_ids, logprobs, strict=True)
        ]
    }


def _entry(ctx: ServerContext, token_id: int, logprob: float) -> dict[str, Any]:
    text = ctx.token_text(token_id)
    return {"token": text, "logprob": json_logprob(logprob), "bytes": list(text.encode())}
