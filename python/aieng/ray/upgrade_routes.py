"""The ingress's admin routes for a rolling upgrade (`aieng.ray.upgrade`), on with `admin_key`:

    POST /admin/upgrade  {"model": "/models/kjv-writer/1.1.0"}   gate it, then roll it out: 202
    GET  /admin/upgrade                                          the last upgrade's progress

Both carry `Authorization: Bearer <admin key>`, a key apart from the API key.
"""

from __future__ import annotations

import hmac
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from aieng.ray.upgrade import RollingUpgrade
from aieng.server.context import ServerContext, context_of
from aieng.server.errors import ApiError, invalid
from aieng.server.model_versions import VersionError

router = APIRouter(include_in_schema=False)


def _admin(request: Request) -> tuple[ServerContext, RollingUpgrade]:
    ctx = context_of(request)
    key = ctx.config.admin_key
    if key is None:
        raise ApiError(404, "the admin API is off (it needs admin_key)")
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
        raise ApiError(401, "the admin key is missing or wrong", code="invalid_admin_key")
    return ctx, request.app.state.rolling_upgrade


@router.post("/admin/upgrade")
async def start_upgrade(request: Request) -> JSONResponse:
    ctx, upgrade = _admin(request)
    try:
        body = await request.json()
    except ValueError:
        raise invalid('the body must be JSON: {"model": "/path/to/version"}', "model") from None
    model = body.get("model") if isinstance(body, dict) else None
    if not isinstance(model, str) or not model:
        raise invalid("field 'model' (a versioned model folder) is required", "model")
    serving = Path(ctx.ready_engine().model_info.model_path)
    try:
        status = upgrade.start(serving, Path(model))
    except VersionError as error:
        raise ApiError(error.status, str(error), code=error.code) from None
    return JSONResponse(status.describe(), 202)


@router.get("/admin/upgrade")
async def upgrade_status(request: Request) -> JSONResponse:
    _ctx, upgrade = _admin(request)
    return JSONResponse(upgrade.status.describe())
