"""The admin API for hot reload (`--model-dir` with `--admin-key`), and the middleware that
tracks which engine each generation request holds.

    GET    /admin/models                               the versions, their states and memory
    POST   /admin/models/{name}/load  {"version": V}   load V beside the serving version, 202
    DELETE /admin/models/{name}/versions/{V}           free a draining (or loading) version

Admin requests carry `Authorization: Bearer <admin key>` — a key separate from the API key, so
API clients cannot switch models. Without `--model-dir` and `--admin-key` these routes are 404.
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from aieng.server.context import ServerContext, context_of
from aieng.server.errors import ApiError, invalid
from aieng.server.model_versions import VersionError

router = APIRouter(include_in_schema=False)
VERSION_HEADER = b"x-aieng-model-version"


def _admin(request: Request) -> ServerContext:
    ctx = context_of(request)
    key = ctx.config.admin_key
    if ctx.versions is None or key is None:
        raise ApiError(404, "the admin API is off (it needs --model-dir and --admin-key)")
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
        raise ApiError(401, "the admin key is missing or wrong", code="invalid_admin_key")
    return ctx


def _check_name(ctx: ServerContext, name: str) -> None:
    assert ctx.versions is not None
    if name != ctx.versions.name:
        raise ApiError(
            404, f"model {name!r} is not served here (this server serves {ctx.versions.name!r})"
        )


def _version_error(error: VersionError) -> ApiError:
    return ApiError(error.status, str(error), code=error.code)


@router.get("/admin/models")
async def list_versions(request: Request) -> JSONResponse:
    ctx = _admin(request)
    assert ctx.versions is not None
    body: dict[str, Any] = {
        "object": "list",
        "serving": f"{ctx.versions.name}@{ctx.versions.serving}",
        "data": ctx.versions.describe(),
    }
    return JSONResponse(body)


@router.post("/admin/models/{name}/load")
async def load_version(name: str, request: Request) -> JSONResponse:
    ctx = _admin(request)
    _check_name(ctx, name)
    try:
        body = await request.json()
    except ValueError:
        message = 'the body must be JSON: {"version": "MAJOR.MINOR.PATCH"}'
        raise invalid(message, "version") from None
    version = body.get("version") if isinstance(body, dict) else None
    if not isinstance(version, str):
        raise invalid("field 'version' (a string) is required", "version")
    assert ctx.versions is not None
    try:
        state = ctx.versions.start_load(ctx, version)
    except VersionError as error:
        raise _version_error(error) from None
    return JSONResponse(state.describe(), 202)


@router.delete("/admin/models/{name}/versions/{version}")
async def unload_version(name: str, version: str, request: Request) -> JSONResponse:
    ctx = _admin(request)
    _check_name(ctx, name)
    assert ctx.versions is not None
    try:
        state = await ctx.versions.unload(version)
    except VersionError as error:
        raise _version_error(error) from None
    return JSONResponse(state.describe())


class EngineLeaseMiddleware:
    """Releases a generation request's hold on its engine once its answer has been sent in
    full (streams included), and names the version that served it in `x-aieng-model-version`."""

    def __init__(self, app: ASGIApp, ctx: ServerContext):
        self.app, self.ctx = app, ctx

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})

        async def send_with_version(message: Message) -> None:
            version = state.get("model_version")
            if message["type"] == "http.response.start" and version is not None:
                header = (VERSION_HEADER, version.encode())
                message["headers"] = [*message.get("headers", []), header]
            await send(message)

        try:
            await self.app(scope, receive, send_with_version)
        finally:
            lease = state.pop("engine_lease", None)
            if lease is not None:
                self.ctx.release_lease(lease)
