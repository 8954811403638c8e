"""The admin API for hot reload (`--model-dir` with `--admin-key`), and the middleware that
tracks which engine each generation request holds.

    GET    /admin/models                               the versions, their states and memory
    POST   /admin/models/{name}/load  {"version": V}   load V beside the serving version, 202
    DELETE /admin/models/{name}/versions/{V}           free a draining (or loading) version
    POST   /admin/models/{name}/route {"version": V, "mode": "canary", "percent": P}
                                      or {"version": V, "mode": "shadow"}   load V as candidate
    DELETE /admin/models/{name}/route                  end it: the candidate drains, is freed

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
from aieng.server.model_versions import ModelVersions, VersionError
from aieng.server.traffic_split import MODES

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


def _versions(ctx: ServerContext, name: str) -> ModelVersions:
    versions = ctx.catalog.get(name)
    if versions is None:
        raise ApiError(
            404,
            f"model {name!r} is not served here (this server serves "
            f"{', '.join(sorted(ctx.catalog))})",
        )
    return versions


def _version_error(error: VersionError) -> ApiError:
    return ApiError(error.status, str(error), code=error.code)


@router.get("/admin/models")
async def list_versions(request: Request) -> JSONResponse:
    ctx = _admin(request)
    assert ctx.versions is not None
    own = ctx.versions
    body: dict[str, Any] = {
        "object": "list",
        "serving": f"{own.name}@{own.serving}",  # the server's own model
        "route": None if own.split is None else own.split.describe(),
        "models": {
            name: {
                "serving": f"{name}@{v.serving}",
                "route": None if v.split is None else v.split.describe(),
            }
            for name, v in sorted(ctx.catalog.items())
        },
        "data": [d for _, v in sorted(ctx.catalog.items()) for d in v.describe()],
    }
    return JSONResponse(body)


@router.post("/admin/models/{name}/load")
async def load_version(name: str, request: Request) -> JSONResponse:
    ctx = _admin(request)
    versions = _versions(ctx, name)
    try:
        body = await request.json()
    except ValueError:
        message = 'the body must be JSON: {"version": "MAJOR.MINOR.PATCH"}'
        raise invalid(message, "version") from None
    version = body.get("version") if isinstance(body, dict) else None
    if not isinstance(version, str):
        raise invalid("field 'version' (a string) is required", "version")
    try:
        state = versions.start_load(ctx, version)
    except VersionError as error:
        raise _version_error(error) from None
    return JSONResponse(state.describe(), 202)


@router.post("/admin/models/{name}/route")
async def start_route(name: str, request: Request) -> JSONResponse:
    ctx = _admin(request)
    versions = _versions(ctx, name)
    body = await _json_object(request)
    version, mode, percent = body.get("version"), body.get("mode"), body.get("percent", 0)
    if not isinstance(version, str):
        raise invalid("field 'version' (a string) is required", "version")
    if mode not in MODES:
        raise invalid(f"field 'mode' must be one of {', '.join(MODES)}, got {mode!r}", "mode")
    if mode == "canary" and (
        not isinstance(percent, int | float) or isinstance(percent, bool) or not 0 < percent <= 100
    ):
        raise invalid(
            f"field 'percent' must be in (0, 100] for a canary, got {percent!r}", "percent"
        )
    try:
        state = versions.start_load(ctx, version, (mode, float(percent)))
    except VersionError as error:
        raise _version_error(error) from None
    return JSONResponse(state.describe(), 202)


@router.delete("/admin/models/{name}/route")
async def end_route(name: str, request: Request) -> JSONResponse:
    ctx = _admin(request)
    versions = _versions(ctx, name)
    try:
        state = await versions.end_split(ctx)
    except VersionError as error:
        raise _version_error(error) from None
    return JSONResponse(state.describe())


async def _json_object(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise invalid("the body must be a JSON object", None) from None
    if not isinstance(body, dict):
        raise invalid("the body must be a JSON object", None)
    return body


@router.delete("/admin/models/{name}/versions/{version}")
async def unload_version(name: str, version: str, request: Request) -> JSONResponse:
    ctx = _admin(request)
    versions = _versions(ctx, name)
    try:
        state = await versions.unload(ctx, version)
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
