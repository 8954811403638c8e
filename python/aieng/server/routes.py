"""The small routes: models, version, health, readiness, metrics, tokenize and detokenize."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from aieng.engine.engine_client import EngineClient
from aieng.server.admission import ServerState
from aieng.server.chat import render_chat
from aieng.server.clients import client_of
from aieng.server.context import ServerContext, context_of
from aieng.server.errors import ApiError, invalid
from aieng.server.offloop import OffLoopBodyRoute
from aieng.server.openapi_docs import ERROR_RESPONSES
from aieng.server.protocol import DetokenizeRequest, TokenizeRequest

router = APIRouter(route_class=OffLoopBodyRoute)

HEARTBEAT_LIMIT_S = 60.0  # a loop silent this long is stuck


@router.get("/v1/models", responses=ERROR_RESPONSES)
async def list_models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": _models(context_of(request))})


def _models(ctx: ServerContext) -> list[dict[str, Any]]:
    """The server's model, and with --model-dir every other model and loaded version."""
    models = [_model(ctx)]
    for name, versions in sorted(ctx.catalog.items()):  # --model-dir: every loaded version
        engine = versions.default_engine(ctx)
        if not versions.primary and engine is not None:
            context = engine.model_info.max_model_len
            models.append({**_model(ctx), "id": name, "root": name, "max_model_len": context})
        for version in sorted({versions.serving, *versions.pinned}):
            engine = versions.engine_for(ctx, version)
            if engine is None:
                continue
            models.append(
                {
                    **_model(ctx),
                    "id": f"{name}@{version}",
                    "root": name,
                    "parent": name,
                    "max_model_len": engine.model_info.max_model_len,
                }
            )
    return models


@router.get("/v1/models/{model_id:path}", responses=ERROR_RESPONSES)
async def retrieve_model(model_id: str, request: Request) -> JSONResponse:
    """The served model by its name (or its path); 404 for any other."""
    ctx = context_of(request)
    if ctx.catalog:
        for model in _models(ctx):
            if model["id"] == model_id:
                return JSONResponse(model)
    if not ctx.config.knows_model(model_id):
        raise ApiError(
            404,
            f"the model {model_id!r} does not exist; this server serves "
            f"{ctx.config.served_model_name!r}",
            "model",
            "model_not_found",
        )
    return JSONResponse(_model(ctx))


@router.get("/version")
async def version() -> JSONResponse:
    from aieng import __version__

    return JSONResponse({"version": __version__})


def _model(ctx: ServerContext) -> dict[str, Any]:
    """The served model by its name; `root` is a name too (vLLM puts the model's path there,
    which would show every key holder the server's folders)."""
    model: dict[str, Any] = {
        "id": ctx.config.served_model_name,
        "object": "model",
        "created": ctx.created,
        "owned_by": "aieng",
        "root": ctx.config.served_model_name,
    }
    if ctx.engine is not None:
        model["max_model_len"] = ctx.engine.model_info.max_model_len
    return model


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """Liveness: the engine loop runs and has turned recently."""
    engine = context_of(request).engine
    if engine is None:
        return JSONResponse({"status": "starting"}, 503)
    body = _liveness(engine)
    return JSONResponse(body, 200 if body["status"] == "ok" else 503)


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    """Readiness: the model is loaded, the engine loop is alive (as /health says) and the
    server is not draining."""
    ctx = context_of(request)
    state = ctx.admission.state
    if state is ServerState.READY and ctx.engine is not None:
        body = _liveness(ctx.engine)
        if body["status"] != "ok":
            return JSONResponse(body, 503)
    return JSONResponse({"status": state.value}, 200 if state is ServerState.READY else 503)


# HEAD probes (load balancers, uptime checks): the same status, no body; kept out of the
# OpenAPI document, where a second operation of one function would repeat its id.
router.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)
router.add_api_route("/ready", ready, methods=["HEAD"], include_in_schema=False)


def _liveness(engine: EngineClient) -> dict[str, Any]:
    age = time.monotonic() - engine.stats.heartbeat
    body: dict[str, Any] = {"status": "ok", "last_heartbeat_s": round(age, 3)}
    if not engine.alive or age > HEARTBEAT_LIMIT_S:
        body["status"] = "dead"
        if engine.failure is not None:
            body["reason"] = engine.failure
    return body


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> Response:
    """Prometheus' text format."""
    registry = context_of(request).metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


@router.post("/tokenize", responses=ERROR_RESPONSES)
async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
    ctx = context_of(request)
    engine = ctx.ready_engine()
    ctx.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise invalid("give exactly one of prompt and messages", "prompt")
    client = client_of(request)
    context = engine.model_info.max_model_len
    if body.messages is not None:
        ids = await render_chat(ctx, client, body.messages, body.add_generation_prompt)
    else:
        assert body.prompt is not None
        tokenizer = engine.tokenizer
        prompt, special = [body.prompt], body.add_special_tokens
        (ids,) = await ctx.tokenizing.encode(client, tokenizer, prompt, special, "prompt", context)
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": context})


@router.post("/detokenize", responses=ERROR_RESPONSES)
async def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
    ctx = context_of(request)
    engine = ctx.ready_engine()
    ctx.check_model(body.model)
    ctx.check_token_ids(body.tokens, "tokens")
    decode, tokens = engine.tokenizer.decode, body.tokens
    text = await ctx.tokenizing.run(client_of(request), len(tokens), decode, tokens, False)
    return JSONResponse({"prompt": text})
