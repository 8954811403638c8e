"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` for every refusal."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


logger = logging.getLogger(__name__)

UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "TextPart", "ChatMessage"}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.code, self.headers)


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code or "invalid_value")


def error_body(status: int, message: str, param: str | None, code: str | None) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class AsciiJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: an error message quoting what a client sent (a lone
    surrogate included) still renders."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return AsciiJSONResponse(error_body(status, message, param, code), status, headers=headers)


def error_bytes(status: int, message: str, param: str | None, code: str | None) -> bytes:
    return json.dumps(error_body(status, message, param, code)).encode()


def internal_error(request_id: str) -> ApiError:
    """What a client is told of an unexpected failure: no exception text, which stays in the
    server log."""
    where = f" (request {request_id})" if request_id else ""
    return ApiError(500, f"internal server error{where}; see the server log", code="internal")


def validation_error(exc: RequestValidationError) -> ApiError:
    """The first problem pydantic found, named by its JSON path ("messages.0.role")."""
    errors = list(exc.errors())
    if not errors:
        return invalid("the request body is invalid")
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body" and not _is_tag(part)]
    kind = first.get("type", "")
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error", first.get("msg", ""))
        return invalid(f"the body is not valid JSON: {detail}", code="invalid_json")
    param = ".".join(loc) or None
    if kind == "extra_forbidden":
        return invalid(f"unsupported field {param!r}", param, "unsupported_field")
    if kind == "missing":
        return invalid(f"missing required field {param!r}", param, "missing_field")
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    where = f"{param}: " if param else ""
    return invalid(f"{where}{message}", param)


def _is_tag(part: object) -> bool:
    """Pydantic names the union member that failed in the location ("str", "list[int]")."""
    if not isinstance(part, str):
        return False
    return "[" in part or part in UNION_TAGS or part.startswith(("constrained-", "function-"))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        request_id = request.scope.get("state", {}).get("request_id", "")
        logger.error("request %s failed", request_id, exc_info=exc)
        response = internal_error(request_id).response()
        if request_id:  # this answer is sent from outside the request-id middleware
            response.headers["x-request-id"] = request_id
        return response

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(exc.status_code, str(exc.detail), None, code, exc.headers)
