"""The FastAPI application: routes, middleware, errors, and the engine's life.

The HTTP listener starts at once and answers 503 while the model loads in a worker thread;
then the engine loop starts beside the event loop and the server becomes ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from aieng.engine.async_engine import AsyncLLMEngine
from aieng.engine.engine_client import EngineClient
from aieng.engine.llm_engine import LLMEngine
from aieng.server import admin, chat, completions, embeddings, routes
from aieng.server.admin import EngineLeaseMiddleware
from aieng.server.config import ServerConfig
from aieng.server.context import ServerContext
from aieng.server.errors import install_error_handlers
from aieng.server.http_metrics import HttpMetricsMiddleware
from aieng.server.middleware import ApiKeyMiddleware, BodyLimitMiddleware, RequestIdMiddleware
from aieng.server.model_versions import (
    ModelVersions,
    default_version,
    scan_model_dir,
    serving_version,
)
from aieng.server.params import IGNORED_FIELDS_HEADER
from aieng.server.served_schema import served_schema

logger = logging.getLogger(__name__)


def build_app(
    config: ServerConfig,
    load_engine: Callable[[], LLMEngine | EngineClient],
    on_load_failure: Callable[[BaseException], None] | None = None,
    load_version: Callable[[Path], LLMEngine] | None = None,
) -> FastAPI:
    """`load_engine` runs in a worker thread at startup; the app serves what it returns (an
    `LLMEngine`, run here by an `AsyncLLMEngine`, or any other `EngineClient`, such as Ray
    replicas behind a router: `aieng.ray`). With
    `config.model_dir`, `load_engine` loads the version `serving_version` picks and
    `load_version(folder)` loads another one for a hot reload."""
    ctx = ServerContext(config)
    if config.model_dir is not None:
        if load_version is None:
            raise ValueError("model_dir needs load_version")
        catalog = scan_model_dir(Path(config.model_dir))
        serving = serving_version(config.model_path, catalog)
        for name, versions in catalog.items():
            own = name == serving.name
            first = serving if own else default_version(versions)
            ctx.catalog[name] = ModelVersions(versions, str(first.version), load_version, own)
        ctx.versions = ctx.catalog[serving.name]

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.create_task(_load(ctx, load_engine, on_load_failure))
        try:
            yield
        finally:
            loading.cancel()
            if ctx.catalog_loading is not None:
                ctx.catalog_loading.cancel()
            for versions in ctx.catalog.values():
                versions.stop_all()
            if ctx.engine is not None:
                ctx.engine.shutdown()
            ctx.tokenizing.shutdown()
            ctx.parsing.shutdown()

    app = FastAPI(
        title="aieng",
        summary="An OpenAI-compatible server over the aieng engine.",
        version=_version(),
        lifespan=lifespan,
    )
    app.state.context = ctx
    install_error_handlers(app)
    for module in (completions, chat, embeddings, routes, admin):
        app.include_router(module.router)
    _without_422(app, ctx)
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=["GET", "HEAD", "POST", "OPTIONS"],
            # any request header: the openai JS client sends its own x-stainless-* ones
            allow_headers=["*"],
            expose_headers=["X-Request-Id", "Retry-After", IGNORED_FIELDS_HEADER],
        )
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=config.max_body_bytes,
        read_timeout=config.request_read_timeout,
        max_concurrent_reads=config.max_concurrent_body_reads,
        body_timeout=config.request_body_timeout,
        max_reads_per_client=config.max_body_reads_per_client,
        on_refused=ctx.metrics.rejected,
        small_first=ctx.small_first,
    )
    if config.api_key:  # outside the body limit: the key is checked before any body is read
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    app.add_middleware(EngineLeaseMiddleware, ctx=ctx)
    # every answer counted, the middleware's own refusals included
    app.add_middleware(
        HttpMetricsMiddleware,
        counter=ctx.metrics.http_requests,
        model_name=config.served_model_name,
    )
    app.add_middleware(RequestIdMiddleware)  # outermost: every answer carries the id
    return app


async def _load(
    ctx: ServerContext,
    load_engine: Callable[[], LLMEngine | EngineClient],
    on_failure: Callable[[BaseException], None] | None,
) -> None:
    try:
        engine = await asyncio.to_thread(load_engine)
    except Exception as error:
        logger.exception("loading the model failed")
        if on_failure is not None:
            on_failure(error)
        return
    if isinstance(engine, LLMEngine):
        async_engine: EngineClient = AsyncLLMEngine(engine, on_step=ctx.metrics.observe_step)
    else:
        async_engine = engine
    async_engine.start()
    await ctx.tokenizing.bytes_per_token(async_engine.tokenizer)  # the byte bound, worked out once
    ctx.attach(async_engine)
    if ctx.catalog:  # the other models of --model-dir, then (if asked) every other version
        ctx.catalog_loading = asyncio.create_task(_load_catalog(ctx))
    logger.info(
        "serving %s (max_model_len %d, %d KV blocks)",
        ctx.config.served_model_name,
        async_engine.model_info.max_model_len,
        async_engine.model_info.num_blocks,
    )


async def _load_catalog(ctx: ServerContext) -> None:
    others = [v for v in ctx.catalog.values() if not v.primary]
    for versions in others:
        await versions.start_default(ctx)
    if ctx.config.serve_all_versions:
        for versions in ctx.catalog.values():
            await versions.load_all(ctx)


def _without_422(app: FastAPI, ctx: ServerContext) -> None:
    """Validation errors answer 400 here, so the document must not promise 422; and once the
    model is loaded, the document states its bounds (served_schema)."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            app.openapi_schema = schema
        return served_schema(app.openapi_schema, ctx.engine and ctx.engine.model_info)

    app.openapi = openapi  # type: ignore[method-assign]


def _version() -> str:
    from aieng import __version__

    return __version__
