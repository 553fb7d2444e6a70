"""The HTTP error shape and the exception handlers that produce it.

Every error the server returns is JSON ``{"error": {"type", "message", "field"?, "code"?}}``
with a 4xx/5xx status: the routes raise ``ApiError``; litestar's own exceptions (validation,
malformed JSON, body too large, unknown route, wrong method) are rewritten to the same shape
with the offending field named; anything else becomes a 500 whose body says only
"internal error" while the traceback goes to the server log. Never a stack trace in a response.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException
from litestar.openapi import ResponseSpec

from specrag.agent.api_models import ErrorResponse

logger = logging.getLogger("specrag.server")

# litestar's status codes mapped to OpenAI-style error types.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "method_not_allowed",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}
_MISSING_FIELD = re.compile(r"missing required field `([^`]+)`")
_UNKNOWN_FIELD = re.compile(r"unknown field `([^`]+)`")


class ApiError(Exception):
    """An error with its HTTP status, raised by the routes and turned into the error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        field: str | None = None,
        type: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.field = field
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "internal_error")
        self.code = code
        self.headers = dict(headers or {})


def invalid(field: str, message: str, *, code: str | None = None) -> ApiError:
    """A 400 naming the request field at fault."""
    return ApiError(400, message, field=field, code=code)


def error_body(type: str, message: str, field: str | None = None, code: str | None = None) -> dict[str, dict[str, str]]:
    error = {"type": type, "message": message}
    if field is not None:
        error["field"] = field
    if code is not None:
        error["code"] = code
    return {"error": error}


def error_response(error: ApiError) -> Response[Any]:
    return Response(
        error_body(error.type, error.message, error.field, error.code),
        status_code=error.status,
        headers=error.headers,
        media_type="application/json",
    )


def _validation_field(extra: Any) -> tuple[str | None, str]:
    """The field path and message of litestar's first validation problem.

    litestar reports the path of the object at fault as ``key`` (``data`` for the body
    itself); for a missing or unknown field, msgspec names the field in the message only,
    so the two are joined into ``messages[0].role``.
    """
    if not isinstance(extra, list) or not extra or not isinstance(extra[0], Mapping):
        return None, "invalid request"
    first = extra[0]
    message = str(first.get("message", "invalid value"))
    key = first.get("key")
    parent = None if key in (None, "", "data") else str(key)
    named = _MISSING_FIELD.search(message) or _UNKNOWN_FIELD.search(message)
    if named:
        return (f"{parent}.{named.group(1)}" if parent else named.group(1)), message
    return parent or "body", message


def handle_api_error(_: Request[Any, Any, Any], error: ApiError) -> Response[Any]:
    return error_response(error)


def handle_http_exception(_: Request[Any, Any, Any], error: HTTPException) -> Response[Any]:
    status = error.status_code
    if isinstance(error, ValidationException):
        field, message = _validation_field(error.extra)
        return error_response(ApiError(400, f"{field}: {message}" if field else message, field=field))
    detail = str(error.detail or "")
    if status == 400:  # malformed JSON (litestar's ClientException) and other body problems
        return error_response(ApiError(400, detail or "bad request", field="body"))
    if status == 413:
        return error_response(ApiError(413, "request body too large", field="body"))
    if status >= 500:
        logger.error("HTTP %s: %s", status, detail)
        return error_response(ApiError(status, "internal error", type="internal_error"))
    headers = {key: value for key, value in (error.headers or {}).items() if key.lower() == "allow"}
    return error_response(ApiError(status, detail or "error", headers=headers))


def handle_unexpected(request: Request[Any, Any, Any], error: Exception) -> Response[Any]:
    logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=error)
    return error_response(ApiError(500, "internal error", type="internal_error"))


EXCEPTION_HANDLERS: dict[type[Exception], Any] = {
    ApiError: handle_api_error,
    HTTPException: handle_http_exception,
    Exception: handle_unexpected,
}

# The error responses each route documents in the OpenAPI schema.
_DESCRIPTIONS = {
    400: "invalid request: the field at fault is named",
    401: "missing or wrong bearer key (when the server has one)",
    404: "unknown trace, or no longer kept",
    413: "request body too large",
    503: "too many requests in flight; retry after Retry-After seconds",
}


def documented(*statuses: int) -> dict[int, ResponseSpec]:
    return {status: ResponseSpec(ErrorResponse, description=_DESCRIPTIONS[status]) for status in statuses}


POST_ERRORS = documented(400, 401, 413, 503)
GET_ERRORS = documented(401)
